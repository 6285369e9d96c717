"""Tokens/s of SGLang with no hidden states, with hsx's capture, and with SGLang's float lists, in one run.

Run inside the real-SGLang CPU lane (or on a GPU with ``--device cuda``):

    bash scripts/sglang_cpu.sh python scripts/bench_sglang.py [--prompts 256] [--hidden 1024] [--layers 8]

Same model, same prompts, same batches, same engine settings (radix cache and chunked prefill off,
token ids in), plain greedy decoding:
  no-hidden  sglang.Engine.generate without hidden states (the limit: nothing leaves the engine);
  capture    hsx.run.pipeline.extract with --sglang-capture tensors, end to end: dataset, rendering,
             engine, rows through hsx's capture files, alignment, bf16 shards with fsync;
  lists      the same with --sglang-capture lists (SGLang's return_hidden_states float lists).
Engine start-up is timed apart and left out of the ratios. The capture run goes first, so the other
two take their prompt ids from its shards. Prints tokens/s (prompt + completion) of each, then the
two ratios last.

``--per-step`` measures what hsx's capture adds to each engine step instead, on one engine per case (the
demo target of ``hsx.demo.spec_models`` plain with ``--layers final``, and with its EAGLE3 head, 3
steps, chain, ``--layers final,eagle3``), at batch sizes ``--batches``:

    bash scripts/sglang_cpu.sh python scripts/bench_sglang.py --per-step [--batches 1,16,64] [--repeats 5]

  plain  ``Engine.generate`` of the same token ids without hidden states, on the same engine;
  hsx    ``SGLangRunner.run`` (the capture writing its files in the scheduler, then read back).
Sides alternate, ``--repeats`` times each after one warm-up each; completion tokens must be equal. Per
engine step (one prefill plus the most decode steps, or verify steps ``spec_verify_ct``, of a request),
medians over the runs: plain's wall time; hsx's own work timed where it runs: in the scheduler (the
lane's ``HSX_LANE_CAPTURE_CLOCK`` times the capture's result-processor wrappers less the SGLang methods
they wrap) and after ``generate`` (reading the files, building the samples), their sum as a share of
the plain step; and the difference of the sides' wall times (noisy on a shared machine).

Both modes write their numbers to ``--json`` (default ``bench_out/bench_sglang.json``); ``--per-step`` the summary of
each case and batch the table shows plus every run's raw measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import hsx
import hsx.engine.registry as loader
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer, demo_corpus
from hsx.engine.sglang.runner import REQUIRED_ARGS, SGLangRunner
from hsx.run.pipeline import extract

ROOT = Path(__file__).resolve().parents[1]
CPU_ARGS = {"attention_backend": "torch_native", "sampling_backend": "pytorch", "disable_cuda_graph": True,
            "mem_fraction_static": 0.3, "max_total_tokens": 65536, "context_length": 1024}


def make_dataset(path: Path, prompts: int, lo: int, hi: int, seed: int = 0) -> Path:
    words = demo_corpus().split()
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(prompts):
        n = int(torch.randint(lo, hi, (1,), generator=gen))
        start = int(torch.randint(0, len(words) - n, (1,), generator=gen))
        lines.append(json.dumps({"id": f"p{i}", "text": " ".join(words[start:start + n])}))
    path.write_text("\n".join(lines) + "\n")
    return path


def timed_extract(cfg: ExtractConfig) -> tuple[float, float, object]:
    """(engine start s, extract s, summary) with the engine started before the clock runs."""
    t0 = time.perf_counter()
    runner = SGLangRunner(cfg)
    started = time.perf_counter() - t0
    build = loader.build_engine
    loader.build_engine = lambda _cfg: runner
    try:
        t1 = time.perf_counter()
        summary = extract(cfg, progress=False)
        seconds = time.perf_counter() - t1
    finally:
        loader.build_engine = build
        runner.engine.shutdown()
    return started, seconds, summary


def no_hidden(cfg: ExtractConfig, prompts: list[list[int]]) -> tuple[float, float, int]:
    """The same engine settings and batches with hidden states off; returns (start s, run s, tokens)."""
    import sglang

    args = {"model_path": cfg.model, "random_seed": cfg.seed, **REQUIRED_ARGS, "enable_return_hidden_states": False,
            **cfg.engine_args}
    if cfg.model_dtype != "auto":
        args["dtype"] = cfg.model_dtype
    if cfg.device != "auto":
        args["device"] = cfg.device
    t0 = time.perf_counter()
    engine = sglang.Engine(**args)
    started = time.perf_counter() - t0
    params = {"max_new_tokens": cfg.max_new_tokens, "temperature": 0.0}
    tokens = 0
    try:
        t1 = time.perf_counter()
        for i in range(0, len(prompts), cfg.batch_size):
            batch = prompts[i:i + cfg.batch_size]
            outs = engine.generate(input_ids=batch, sampling_params=params)
            tokens += sum(len(p) + len(o["output_ids"]) for p, o in zip(batch, outs))
        seconds = time.perf_counter() - t1
    finally:
        engine.shutdown()
    return started, seconds, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--min-words", type=int, default=40)
    ap.add_argument("--max-words", type=int, default=120)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "bench_sglang.json", help="where the numbers go")
    ap.add_argument("--per-step", action="store_true", help="hsx's added time per engine step, one engine per case")
    ap.add_argument("--batches", default="1,16,64", help="batch sizes of --per-step")
    ap.add_argument("--repeats", type=int, default=5, help="runs a side of --per-step")
    ap.add_argument("--new-tokens", type=int, default=32, help="completion tokens per prompt in --per-step")
    ap.add_argument("--cases", default="plain,EAGLE3", help="--per-step cases: plain, EAGLE3 or both")
    args = ap.parse_args(argv)
    if args.per_step:
        return per_step_main(args)
    if args.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    work = args.work or Path(tempfile.mkdtemp(prefix="hsx-bench-sglang-"))
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=args.layers, hidden_size=args.hidden, vocab_size=len(tok), seed=0,
                             num_attention_heads=8, num_key_value_heads=8, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    data = make_dataset(work / "prompts.jsonl", args.prompts, args.min_words, args.max_words)

    def cfg(name: str, capture: str) -> ExtractConfig:
        return ExtractConfig(model=str(work / "model"), engine="sglang", dataset=str(data), output=str(work / name),
                             id_field="id", device=args.device, model_dtype="float32", dtype="bfloat16",
                             layers="final", max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                             sglang_capture=capture, engine_args=dict(CPU_ARGS) if args.device == "cpu" else {})

    results = {}
    start, secs, summary = timed_extract(cfg("capture", "tensors"))
    results["capture"] = {"start_s": start, "s": secs, "tokens": summary.tokens, "errors": summary.errors}
    ds = hsx.open(work / "capture")
    prompts = [s.input_ids[:s.prompt_len].tolist() for s in ds]
    start, secs, summary = timed_extract(cfg("lists", "lists"))
    results["lists"] = {"start_s": start, "s": secs, "tokens": summary.tokens, "errors": summary.errors}
    start, secs, tokens = no_hidden(cfg("none", "tensors"), prompts)
    results["no-hidden"] = {"start_s": start, "s": secs, "tokens": tokens, "errors": 0}

    rows = sum(len(s.input_ids) - 1 for s in ds)
    print(f"\nmodel: {args.layers} blocks, hidden {args.hidden}, fp32 compute on {args.device}; {args.prompts} prompts "
          f"({sum(map(len, prompts))} prompt tokens), {args.max_new_tokens} new tokens each, batch {args.batch_size}; "
          f"{rows} rows x {args.hidden} stored as bf16 ({rows * args.hidden * 2 / 1e6:.1f} MB)")
    for name in ("no-hidden", "capture", "lists"):
        r = results[name]
        r["tok_s"] = r["tokens"] / r["s"]
        print(f"  {name:<10} {r['tokens']:>7} tokens in {r['s']:7.1f} s = {r['tok_s']:8.0f} tok/s "
              f"(engine start {r['start_s']:.1f} s, errors {r['errors']})")
    a, b, c = (results[n]["tok_s"] for n in ("no-hidden", "capture", "lists"))
    write_json(args, {"mode": "whole-process", "work": str(work), "results": results})
    print(f"capture/no-hidden = {b / a:.2f}x, capture/lists = {b / c:.2f}x")
    return 0


# ---- --per-step ---------------------------------------------------------------------------------------

PER_STEP_ARGS = {**CPU_ARGS, "mem_fraction_static": 0.15, "max_total_tokens": 32768, "sleep_on_idle": True}


def engine_steps(outs: list[dict], speculative: bool) -> int:
    """One prefill plus the most decode (or verify) steps any request of the batch took."""
    key = "spec_verify_ct" if speculative else "completion_tokens"
    most = max(int(o["meta_info"][key]) for o in outs)
    return 1 + (most if speculative else most - 1)


def per_step_case(label: str, cfg: ExtractConfig, batches: list[int], repeats: int, clock: Path) -> list[dict]:
    from transformers import AutoTokenizer

    from hsx.data.render import Prompt

    runner = SGLangRunner(cfg)
    speculative = cfg.spec_algorithm is not None
    tok = AutoTokenizer.from_pretrained(cfg.model)
    words = demo_corpus().split()
    generate = runner.engine.generate
    inside = {"s": 0.0, "steps": 0}

    def timed_generate(*args, **kwargs):
        t = time.perf_counter()
        outs = generate(*args, **kwargs)
        inside["s"] += time.perf_counter() - t
        inside["steps"] = engine_steps(outs if isinstance(outs, list) else [outs], speculative)
        return outs

    def plain(prompts) -> dict:
        t = time.perf_counter()
        outs = generate(input_ids=[p.input_ids for p in prompts], sampling_params=runner._sampling())
        return {"wall": time.perf_counter() - t, "steps": engine_steps(outs, speculative),
                "tokens": sum(len(o["output_ids"]) for o in outs)}

    def captured(prompts) -> dict:
        inside["s"] = 0.0
        clock.write_text("")
        runner.engine.generate = timed_generate
        try:
            t = time.perf_counter()
            samples = runner.run(prompts)
            wall = time.perf_counter() - t
        finally:
            runner.engine.generate = generate
        bad = [s for s in samples if not hasattr(s, "input_ids")]
        if bad:
            raise SystemExit(f"{label}: hsx failed a sample: {bad[0]}")
        in_step = sum(float(x) for x in clock.read_text().split())
        return {"wall": wall, "steps": inside["steps"], "in_step": in_step, "after": wall - inside["s"],
                "tokens": sum(int(s.input_ids.numel()) - int(s.prompt_len) for s in samples)}

    rows = []
    try:
        for b in batches:
            texts = [" ".join(words[(i * 37) % (len(words) - 80):][: 8 + (i * 13) % 72]) for i in range(b)]
            ids = [list(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]
            prompts = [Prompt(f"p{i}", i, x, [1] * len(x)) for i, x in enumerate(ids)]
            plain(prompts), captured(prompts)  # warm-up
            runs = {"plain": [], "hsx": []}
            for k in range(repeats):
                for side in ("plain", "hsx") if k % 2 == 0 else ("hsx", "plain"):
                    runs[side].append(plain(prompts) if side == "plain" else captured(prompts))
            summary = per_step_summary(label, b, runs)
            rows.append({"case": label, "batch": b, "summary": summary, "runs": runs})
            print(f"[bench] {per_step_row(label, b, summary)}", flush=True)
    finally:
        runner.engine.shutdown()
    return rows


def per_step_summary(label: str, batch: int, runs: dict[str, list[dict]]) -> dict:
    """ms per engine step, medians over the runs: hsx's own work timed where it runs, and the sides' difference."""
    tokens = {r["tokens"] for side in runs.values() for r in side}
    if len(tokens) != 1:
        raise SystemExit(f"{label} batch {batch}: completion tokens differ between runs or sides: {tokens}")
    n = max(r["steps"] for side in runs.values() for r in side)

    def ms(side, key):
        return statistics.median(1e3 * r[key] / n for r in runs[side])

    added = statistics.median(1e3 * (h["wall"] - p["wall"]) / n for h, p in zip(runs["hsx"], runs["plain"], strict=True))
    plain_wall, in_step, after = ms("plain", "wall"), ms("hsx", "in_step"), ms("hsx", "after")
    return {"steps": n, "plain_ms": plain_wall, "in_step_ms": in_step, "after_ms": after,
            "own_share": (in_step + after) / plain_wall, "wall_added_ms": added}


def per_step_row(label: str, batch: int, s: dict) -> str:
    return (f"| {label} | {batch} | {s['steps']} | {s['plain_ms']:.2f} | {s['in_step_ms']:.3f} | {s['after_ms']:.3f} | "
            f"{100 * s['own_share']:.1f}% | {s['wall_added_ms']:+.2f} |")


def write_json(args, results: dict) -> None:
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": settings, "cpus": os.cpu_count(), **results}, indent=1, default=str))
    print(f"wrote {args.json}")


def per_step_main(args) -> int:
    from hsx.demo.spec_models import build_spec_models

    torch.set_num_threads(os.cpu_count() or 1)
    work = args.work or Path(tempfile.mkdtemp(prefix="hsx-bench-sglang-"))
    models = build_spec_models(work / "models")
    base = dict(model=str(models.target), engine="sglang", device="cpu", model_dtype="float32", dtype="bfloat16",
                max_new_tokens=args.new_tokens, seed=0, engine_args=dict(PER_STEP_ARGS))
    cases = [("demo plain", ExtractConfig(**base, layers="final")),
             ("demo EAGLE3", ExtractConfig(**base, layers="final,eagle3", eagle3_layer_ids=[1, 3, 5],
                                           spec_algorithm="EAGLE3", draft_model=str(models.eagle3), spec_num_steps=3,
                                           spec_topk=1, spec_num_draft_tokens=4))]
    cases = [(label, cfg) for label, cfg in cases if label.split()[-1] in args.cases.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    clock = Path(os.environ.setdefault("HSX_LANE_CAPTURE_CLOCK", str(work / "capture-clock.txt")))
    rows = []
    for label, cfg in cases:
        rows += per_step_case(label, cfg, batches, args.repeats, clock)
    print("\n".join(["| case | batch | engine steps | plain ms/step | hsx in the scheduler, ms/step | "
                     "hsx after generate, ms/step | hsx's own / plain | wall added, ms/step |",
                     "|---|---|---|---|---|---|---|---|",
                     *(per_step_row(r["case"], r["batch"], r["summary"]) for r in rows)]))
    print(f"[bench] {os.cpu_count()} CPUs, {args.repeats} runs a side, {args.new_tokens} new tokens a prompt")
    write_json(args, {"mode": "per-step", "cases": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
