"""Peak resident memory of a prefill-mode `hsx extract` over one long prompt, one process per setting.

The workload is built here (no download): a demo-style random Llama (--blocks x --hidden, --heads
attention heads sharing --kv-heads key/value heads as real models do, fp32 on the CPU, context
2 x --tokens) with the demo tokenizer, and one plain-text sample of about --tokens
tokens made of the demo corpus. Each setting runs in a fresh process and reports two numbers:

  prefill peak   the resident set's peak during the prefill call above the resident set when it
                 started (the peak is reset there through /proc/self/clear_refs): what the forward's
                 activations, masks, cache and rows cost, the model and the libraries aside
  process peak   the whole process's peak (VmHWM in /proc/self/status), imports and model load included

Settings:

  bare forward   the same model called as a user would, one forward over the long prompt with
                 output_hidden_states=True and transformers' own causal mask: every boundary of
                 every position held at once (not hsx)
  hsx one-shot   hsx extract --mode prefill --layers LAYERS (HFEngine.prefill is the call measured)
  hsx chunk N    the same with --prefill-chunk N, for each N of --chunks

--before DIR adds "before one-shot", the hsx one-shot setting run with the hsx package found in
DIR (e.g. `git archive OLD_COMMIT hsx | tar -x -C DIR`), to compare a change with what it replaces.
Every hsx setting must store the same number of rows (one per token). Results go to
bench_out/prefill_memory.json.

    python scripts/prefill_memory.py                       # 8192 tokens, 8 blocks x hidden 256, chunks 512
    python scripts/prefill_memory.py --tokens 4096 --blocks 12 --hidden 768 --heads 8   # wider states
    python scripts/prefill_memory.py --before /tmp/hsx-before --chunks 256,1024 --layers final
    python scripts/prefill_memory.py --quick               # 512 tokens, 4 blocks: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {key}: this script needs Linux")


class PeakMeter:
    """The resident set's peak over a stretch of this process, above the resident set at its start."""

    def __enter__(self) -> "PeakMeter":
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.start = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.above_mib = (_status_kib("VmHWM") - self.start) / 1024


# --- one setting (run as `python prefill_memory.py _run SETTING ...`) ---


def run_hsx(model: str, data: str, out: str, layers: str, chunk: int | None) -> dict:
    import hsx
    from hsx.engine.hf import engine as hf

    calls = []
    prefill = hf.HFEngine.prefill

    def measured(self, requests):
        with PeakMeter() as meter:
            samples = prefill(self, requests)
        calls.append(meter.above_mib)
        return samples

    hf.HFEngine.prefill = measured
    chunked = {} if chunk is None else {"prefill_chunk": chunk}  # (a --before package may not know the field)
    hsx.extract(hsx.ExtractConfig(model=model, dataset=data, output=out, mode="prefill", layers=layers, batch_size=1,
                                  **chunked), progress=False, overwrite=True)
    ds = hsx.open(out)
    return {"samples": len(ds), "tokens": sum(len(s.input_ids) for s in ds), "rows": sum(s.num_rows for s in ds),
            "prefill_peak_mib": max(calls), "hsx": str(Path(hsx.__file__).parent)}


def run_all_layers(model_dir: str, data: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    text = json.loads(Path(data).read_text().splitlines()[0])["text"]
    ids = torch.tensor([tok(text)["input_ids"]])  # [1, T]
    with torch.inference_mode(), PeakMeter() as meter:
        out = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
        states = len(out.hidden_states)
        del out
    return {"samples": 1, "tokens": ids.shape[1], "rows": ids.shape[1], "hidden_state_tensors": states,
            "prefill_peak_mib": meter.above_mib}


def child(argv: list[str]) -> None:
    setting, model, data, out, layers, chunk, threads = argv
    import torch

    torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    if setting == "all-layers":
        counts = run_all_layers(model, data)
    else:
        counts = run_hsx(model, data, out, layers, None if chunk == "-" else int(chunk))
    print(json.dumps({**counts, "seconds": time.perf_counter() - t0, "process_peak_mib": _status_kib("VmHWM") / 1024}))


# --- the workload and the table ---


def build_workload(work: Path, args) -> dict:
    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer, demo_corpus

    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=args.blocks, hidden_size=args.hidden, vocab_size=len(tok),
                             num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                             max_position_embeddings=2 * args.tokens, eos_token_id=tok.eos_token_id,
                             bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(work / "target")
    tok.save_pretrained(work / "target")
    del model
    words = demo_corpus().split()
    text, n = [], 0
    while n < args.tokens:  # the corpus again and again, cut where the tokenizer reaches --tokens
        text += words
        n = len(tok(" ".join(text))["input_ids"])
    lo, hi = 1, len(text)
    while lo < hi:  # fewest words reaching --tokens tokens
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(tok(" ".join(text[:mid]))["input_ids"]) < args.tokens else (lo, mid)
    data = work / "long.jsonl"
    data.write_text(json.dumps({"id": "long", "text": " ".join(text[:lo])}) + "\n")
    return {"model": str(work / "target"), "long": str(data)}


def measure(name: str, cmd_args: list[str], src: Path, threads: int) -> dict:
    t = str(threads)
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t}
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_run", *cmd_args], env=env,
                       capture_output=True, text=True, cwd=src)
    if p.returncode != 0:
        raise SystemExit(f"{name} failed (exit {p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the long prompt")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: a quarter of --heads)")
    ap.add_argument("--layers", default="final,eagle3", help="--layers of the hsx settings")
    ap.add_argument("--chunks", default="512", help="comma-separated --prefill-chunk sizes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--before", type=Path, default=None, help="a directory holding another hsx package")
    ap.add_argument("--quick", action="store_true", help="512 tokens, 4 blocks x hidden 64, chunk 128")
    ap.add_argument("--work", type=Path, default=ROOT / "bench_out" / "prefill_memory_work")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "prefill_memory.json")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.blocks, args.hidden, args.chunks = 512, 4, 64, "128"
    args.kv_heads = args.kv_heads or max(1, args.heads // 4)
    args.work.mkdir(parents=True, exist_ok=True)
    w = build_workload(args.work, args)
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]

    def hsx_args(data: str, out: str, chunk: int | None) -> list[str]:
        return ["hsx", w["model"], data, str(args.work / out), args.layers, "-" if chunk is None else str(chunk),
                str(args.threads)]

    settings = [("bare forward", ["all-layers", w["model"], w["long"], "-", "-", "-", str(args.threads)], ROOT),
                ("hsx one-shot", hsx_args(w["long"], "out-oneshot", None), ROOT)]
    if args.before is not None:
        settings.append(("before one-shot", hsx_args(w["long"], "out-before", None), args.before.resolve()))
    settings += [(f"hsx chunk {c}", hsx_args(w["long"], f"out-chunk{c}", c), ROOT) for c in chunks]
    results = {}
    for name, cmd_args, src in settings:
        results[name] = measure(name, cmd_args, src, args.threads)
        print(f"  {name}: prefill peak {results[name]['prefill_peak_mib']:.0f} MiB", file=sys.stderr, flush=True)
    hsx_rows = {n: r["rows"] for n, r in results.items() if n != "bare forward"}
    if len(set(hsx_rows.values())) != 1:
        raise SystemExit(f"the hsx settings stored different row counts: {hsx_rows}")

    tokens = results["hsx one-shot"]["tokens"]
    print(f"prefill of one {tokens}-token prompt, {args.blocks} blocks x hidden {args.hidden} ({args.heads} heads, "
          f"{args.kv_heads} kv), --layers {args.layers}, fp32 on the CPU, {args.threads} thread(s)")
    print(f"{'setting':<18}{'prefill peak MiB':>18}{'process peak MiB':>18}{'seconds':>9}")
    for name, r in results.items():
        print(f"{name:<18}{r['prefill_peak_mib']:>18.0f}{r['process_peak_mib']:>18.0f}{r['seconds']:>9.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_run":
        child(sys.argv[2:])
    else:
        main()
