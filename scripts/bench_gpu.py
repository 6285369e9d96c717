"""Prefill extraction at Llama-3.1-8B's shape: `hsx extract` against a bare transformers forward.

NOT YET MEASURED ON A GPU: the script has been run only in its --tiny mode on a CPU. The times
below are estimates.

Needs no download. Builds a random-init model with Llama-3.1-8B's config (hidden 4096, 32 blocks,
32 heads, 8 kv heads, MLP 14336, vocab 128256, rope_theta 500000 with llama3 rope scaling, context
131072, untied embeddings) in bf16 on the device, saves it with a word-level tokenizer whose
128,256 ids cover the whole vocabulary, and writes prompts of random words (2,000 of 500-600 tokens
by default, BOS included; SpecForge's benchmark shape). Then, each as its own process:
  bare  the same prompts tokenized the same way, right-padded dataset-order batches,
        model(input_ids, attention_mask, output_hidden_states=True) under torch.inference_mode(),
        nothing kept;
  hsx   hsx extract --mode prefill --layers final,eagle3 --eagle3-layer-ids 1,15,28
        --model-dtype bfloat16 --dtype bfloat16, rows written to shards.
It reports prompt tokens/s of each over its whole process (spawn to exit, model load included) and
the ratio; the bare side's forward-only rate and hsx's own run time (model load included, imports
not); peak GPU memory (torch.cuda.max_memory_allocated / reserved in the bare side, nvidia-smi
samples every 0.2 s for both); and bytes/s written by hsx (output size / hsx wall time). The free
disk is checked first: the default run needs about 16 GB for the model and 36 GB for the output
(2,000 x 550 tokens x 4 columns x 4096 x 2 bytes); the output is deleted afterwards unless
--keep-output. Results go to OUT/bench_gpu.json.

Expected time on one H200 (estimated): model init + save 1-2 min, bare side 1-1.5 min, hsx 1.5-3
min, under 7 min in all; --prompts 500 for a quick look.

    bash scripts/bench_gpu.sh                                 # the default run, on cuda
    bash scripts/bench_gpu.sh --prompts 500 --out /scratch/b  # smaller, elsewhere
    bash scripts/bench_gpu.sh --reuse-model                   # skip the build when OUT/model exists
    python scripts/bench_gpu.py --tiny                        # CPU smoke test: 2 blocks, 8 prompts

--max-batch-tokens and every --hsx-arg are passed to hsx (only when given).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])

LLAMA31_8B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
    vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
TINY = dict(LLAMA31_8B, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=1024)
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"]  # ids 0..3; words w4 .. w{V-1} after them


# --- the model, tokenizer and prompts ---


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer: token i < 4 is a special token, token i >= 4 is the word f"w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", unk_token="<|unk|>", model_max_length=131072)


def build_model(model_dir: Path, shape: dict, device: str) -> dict:
    """Random bf16 weights, made on the meta device and materialised on ``device`` (no CPU copy)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=2, dtype="bfloat16")
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)  # RMSNorm weights
            else:
                p.normal_(0.0, 0.02, generator=gen)
    # rotary inv_freq is a non-persistent buffer: not saved, rebuilt by from_pretrained on each side
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(model_dir)
    build_tokenizer(shape["vocab_size"]).save_pretrained(model_dir)
    save_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"init_s": init_s, "save_s": save_s, "params": params}


def write_prompts(path: Path, n: int, lo: int, hi: int, vocab_size: int) -> int:
    """``n`` rows of random words; row i tokenizes to a length in [lo, hi], BOS included. Returns the tokens."""
    import numpy as np

    rng = np.random.default_rng(0)
    total = 0
    with path.open("w") as f:
        for i in range(n):
            k = int(rng.integers(lo, hi + 1))
            words = " ".join(f"w{t}" for t in rng.integers(len(SPECIALS), vocab_size, k - 1))
            f.write(json.dumps({"id": f"p{i}", "text": words}) + "\n")
            total += k
    return total


# --- the bare side (run as `python bench_gpu.py _bare MODEL DATA BATCH DEVICE`) ---


def bare_forward(model_dir: str, data: str, batch_size: int, device: str) -> dict:
    t_start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = device.startswith("cuda")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to(device).eval()
    texts = [json.loads(line)["text"] for line in Path(data).read_text().splitlines()]
    ids = tok(texts, add_special_tokens=True)["input_ids"]
    load_s = time.perf_counter() - t_start
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(ids), batch_size):
            batch = ids[start : start + batch_size]
            width = max(len(x) for x in batch)
            input_ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)  # [B, T]
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, x in enumerate(batch):
                input_ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x)] = 1
            model(input_ids=input_ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            tokens += int(mask.sum())
    if cuda:
        torch.cuda.synchronize()
    forward_s = time.perf_counter() - t0
    return {"samples": len(ids), "tokens": tokens, "load_s": load_s, "forward_s": forward_s,
            "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None}


# --- the timed processes ---


class GpuMemorySampler:
    """Peak `memory.used` of the device from nvidia-smi, sampled in a thread; None without nvidia-smi."""

    def __init__(self, device: str, every_s: float = 0.2):
        self.enabled = device.startswith("cuda") and shutil.which("nvidia-smi") is not None
        self.index = device.partition(":")[2] or os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        self.every_s, self.peak_mib, self._stop = every_s, None, threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            p = subprocess.run(["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True)
            if p.returncode == 0 and p.stdout.strip():
                self.peak_mib = max(self.peak_mib or 0, int(p.stdout.split()[0]))
            self._stop.wait(self.every_s)

    def __enter__(self):
        if self.enabled:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._stop.set()
            self._thread.join()


def timed(cmd: list[str], device: str, what: str) -> tuple[float, str, int | None]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    with GpuMemorySampler(device) as mem:
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{what} failed (exit {p.returncode}):\n{' '.join(cmd)}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return wall, p.stdout, mem.peak_mib


def run_hsx(args, model_dir: Path, data: Path, out: Path) -> dict:
    from hsx.shards.verify import inspect

    shutil.rmtree(out, ignore_errors=True)  # an existing output would be resumed, not redone
    cmd = [sys.executable, "-m", "hsx.cli", "extract", "--model", str(model_dir), "--dataset", str(data),
           "--id-field", "id", "--output", str(out), "--mode", "prefill", "--layers", args.layers,
           "--model-dtype", "bfloat16", "--dtype", "bfloat16", "--batch-size", str(args.batch_size),
           "--device", args.device]  # not --quiet: its summary has the run's seconds and the writer's wait
    if args.eagle3_layer_ids:
        cmd += ["--eagle3-layer-ids", args.eagle3_layer_ids]
    if args.max_batch_tokens is not None:
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    cmd += args.hsx_arg
    wall, stdout, peak = timed(cmd, args.device, "hsx extract")
    s = inspect(out)
    if s["errors"]:
        raise SystemExit(f"hsx extract recorded {s['errors']} input errors: {s['error_records'][:3]}")
    found = re.search(r" in ([0-9.]+) s, start-up included", stdout)
    waited = re.search(r"the engine waited ([0-9.]+) s on it", stdout)  # not under --ray: a writer per worker
    if not found:
        raise SystemExit(f"hsx extract printed no summary with its seconds:\n{stdout[-2000:]}")
    return {"wall_s": wall, "run_s": float(found.group(1)), "writer_blocked_s": float(waited.group(1)) if waited else None,
            "samples": s["samples"],
            "tokens": s["tokens"], "bytes": s["bytes"], "rows_per_column": s["rows_per_column"],
            "columns": [g["name"] for g in s["layers"]], "nvidia_smi_peak_mib": peak}


def run_bare(args, model_dir: Path, data: Path) -> dict:
    cmd = [sys.executable, __file__, "_bare", str(model_dir), str(data), str(args.batch_size), args.device]
    wall, stdout, peak = timed(cmd, args.device, "bare forward")
    return {"wall_s": wall, **json.loads(stdout.strip().splitlines()[-1]), "nvidia_smi_peak_mib": peak}


def check_disk(args, shape: dict, out: Path, need_model: bool) -> dict:
    w = shape["hidden_size"]
    columns = sum(3 if c.strip() == "eagle3" else 1 for c in args.layers.split(","))
    mean_tokens = (args.min_tokens + args.max_tokens) / 2
    output = int(args.prompts * mean_tokens * columns * w * 2 * 1.05)  # bf16 rows, ~5% for ids and metadata
    h, kv, layers, v, m = (shape[k] for k in ("hidden_size", "num_key_value_heads", "num_hidden_layers",
                                               "vocab_size", "intermediate_size"))
    head = h // shape["num_attention_heads"]
    params = 2 * v * h + layers * (2 * h * h + 2 * h * kv * head + 3 * h * m + 2 * h) + h
    model = 2 * params if need_model else 0
    free = shutil.disk_usage(out).free
    if model + output > free:
        per_prompt = output / args.prompts
        fits = int((free - model) / per_prompt) if free > model else 0
        raise SystemExit(f"{out}: {free / 1e9:.1f} GB free, the run needs about {model / 1e9:.1f} GB for the model "
                         f"and {output / 1e9:.1f} GB for the output; use --prompts {fits} or less, or --out elsewhere")
    return {"free_bytes": free, "model_bytes_est": model, "output_bytes_est": output}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="2 blocks x hidden 128, vocab 1024, 8 prompts of 20-40 tokens, "
                                                        "on the CPU: a smoke test")
    ap.add_argument("--prompts", type=int, help="default 2000 (--tiny 8)")
    ap.add_argument("--min-tokens", type=int, help="shortest prompt, BOS included (default 500; --tiny 20)")
    ap.add_argument("--max-tokens", type=int, help="longest prompt (default 600; --tiny 40)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--layers", default="final,eagle3")
    ap.add_argument("--eagle3-layer-ids", help="default 1,15,28 (--tiny 0,0,1)")
    ap.add_argument("--device", help="default cuda (--tiny cpu)")
    ap.add_argument("--out", default="bench_out/gpu", help="model, prompts, output and bench_gpu.json")
    ap.add_argument("--reuse-model", action="store_true", help="keep OUT/model if it exists (same shape assumed)")
    ap.add_argument("--keep-output", action="store_true", help="keep hsx's shards (deleted by default)")
    ap.add_argument("--max-batch-tokens", type=int, help="passed to hsx")
    ap.add_argument("--hsx-arg", action="append", default=[], help="an extra hsx extract argument (repeatable; "
                                                                     "--hsx-arg=--flag for ones starting with -)")
    args = ap.parse_args(argv)
    for k, full, tiny in (("prompts", 2000, 8), ("min_tokens", 500, 20), ("max_tokens", 600, 40),
                          ("eagle3_layer_ids", "1,15,28", "0,0,1"), ("device", "cuda", "cpu")):
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else full)
    if not 2 <= args.min_tokens <= args.max_tokens:
        ap.error("need 2 <= --min-tokens <= --max-tokens")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    shape = TINY if args.tiny else LLAMA31_8B
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir, data, shards = out / "model", out / "prompts.jsonl", out / "hsx_out"
    shutil.rmtree(shards, ignore_errors=True)
    reuse = args.reuse_model and (model_dir / "config.json").exists()
    disk = check_disk(args, shape, out, need_model=not reuse)
    report = {"settings": {k: v for k, v in vars(args).items()}, "shape": shape, "disk": disk}
    if reuse:
        print(f"model: reusing {model_dir}", flush=True)
    else:
        shutil.rmtree(model_dir, ignore_errors=True)
        print(f"model: building {'tiny' if args.tiny else 'Llama-3.1-8B-shaped'} random weights on {args.device}",
              flush=True)
        report["build"] = build_model(model_dir, shape, args.device)
        print(f"  init {report['build']['init_s']:.1f} s, save {report['build']['save_s']:.1f} s, "
              f"{report['build']['params']:,} parameters", flush=True)
    tokens = write_prompts(data, args.prompts, args.min_tokens, args.max_tokens, shape["vocab_size"])
    print(f"prompts: {args.prompts:,}, {tokens:,} tokens", flush=True)

    bare = run_bare(args, model_dir, data)
    print(f"bare forward: {bare['wall_s']:.1f} s whole process ({bare['forward_s']:.1f} s forward)", flush=True)
    hsx = run_hsx(args, model_dir, data, shards)
    print(f"hsx extract:  {hsx['wall_s']:.1f} s whole process, {hsx['bytes'] / 1e6:,.1f} MB written", flush=True)
    if not args.keep_output:
        shutil.rmtree(shards, ignore_errors=True)
    if not (bare["tokens"] == hsx["tokens"] == tokens and bare["samples"] == hsx["samples"] == args.prompts):
        raise SystemExit(f"token counts differ: prompts {tokens}, bare {bare['tokens']}, hsx {hsx['tokens']}")

    rates = {"bare_tokens_per_s": tokens / bare["wall_s"], "hsx_tokens_per_s": tokens / hsx["wall_s"],
             "bare_forward_only_tokens_per_s": tokens / bare["forward_s"],
             "hsx_bytes_per_s": hsx["bytes"] / hsx["wall_s"]}
    rates["ratio_hsx_to_bare"] = rates["hsx_tokens_per_s"] / rates["bare_tokens_per_s"]
    report.update(bare=bare, hsx=hsx, tokens=tokens, **rates)
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:,.0f} MiB"  # noqa: E731
    smi = lambda m: "n/a" if m is None else f"{m:,} MiB"  # noqa: E731
    print(f"\nprefill, {args.prompts:,} prompts / {tokens:,} tokens, batch {args.batch_size}, layers {args.layers}, "
          f"{shape['num_hidden_layers']} blocks x {shape['hidden_size']}, bf16 on {args.device}")
    print(f"  bare forward  {rates['bare_tokens_per_s']:>12,.0f} tokens/s whole process  "
          f"({rates['bare_forward_only_tokens_per_s']:,.0f} forward only; load {bare['load_s']:.1f} s)")
    print(f"  hsx extract   {rates['hsx_tokens_per_s']:>12,.0f} tokens/s whole process  "
          f"(its run: {hsx['run_s']:.1f} s incl. model load; the engine waited {hsx['writer_blocked_s']} s on "
          "the shard writer)")
    print(f"  written       {rates['hsx_bytes_per_s'] / 1e6:>12,.1f} MB/s  ({hsx['bytes'] / 1e6:,.1f} MB, "
          f"columns {hsx['columns']})")
    print(f"  peak GPU mem  bare: allocated {mib(bare['max_memory_allocated'])}, reserved "
          f"{mib(bare['max_memory_reserved'])}, nvidia-smi {smi(bare['nvidia_smi_peak_mib'])}; "
          f"hsx: nvidia-smi {smi(hsx['nvidia_smi_peak_mib'])}")
    print(f"  hsx / bare forward = {rates['ratio_hsx_to_bare']:.2f}x (whole processes)")
    (out / "bench_gpu.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'bench_gpu.json'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_bare":
        model_dir, data, bs, device = sys.argv[2:]
        print(json.dumps(bare_forward(model_dir, data, int(bs), device)))
    else:
        main()
