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
"""

from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
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
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"work": str(work), "json": str(args.json)},
                                         "results": results}, indent=1, default=str))
    print(f"capture/no-hidden = {b / a:.2f}x, capture/lists = {b / c:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
