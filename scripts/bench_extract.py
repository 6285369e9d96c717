"""Throughput of `hsx extract` in prefill mode against a bare transformers forward, in one run.

Both sides see the same tokenized samples in the same batches on the same model:
  baseline  model(input_ids, attention_mask, output_hidden_states=True) over right-padded batches
            (forward only: no dataset, no alignment, no I/O);
  hsx       hsx.pipeline.extract(...) end to end: dataset load, rendering, engine, alignment,
            bf16 rows written to shards with fsync and manifest.
Prints tokens/s for each and their ratio, and writes JSON.

    python scripts/bench_extract.py [--samples 192] [--hidden 512] [--layers 8] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hsx.config import ExtractConfig
from hsx.data.render import Renderer
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer, demo_corpus
from hsx.pipeline import extract


def make_dataset(path: Path, samples: int, seed: int = 0) -> Path:
    words = demo_corpus().split()
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(samples):
        n = int(torch.randint(60, 240, (1,), generator=gen))
        start = int(torch.randint(0, len(words) - n, (1,), generator=gen))
        lines.append(json.dumps({"id": f"b{i}", "text": " ".join(words[start : start + n])}))
    path.write_text("\n".join(lines) + "\n")
    return path


def baseline(model, batches) -> tuple[float, int]:
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            width = max(len(x) for x in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.int64)
            mask = torch.zeros(len(batch), width, dtype=torch.int64)
            for i, x in enumerate(batch):
                ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x)] = 1
            model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            tokens += int(mask.sum())
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="bench_out/bench_extract.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = build_demo_tokenizer()
        model = build_tiny_llama(num_layers=args.layers, hidden_size=args.hidden, vocab_size=len(tok),
                                 num_attention_heads=8, num_key_value_heads=8, eos_token_id=tok.eos_token_id)
        model.save_pretrained(tmp / "model")
        tok.save_pretrained(tmp / "model")
        data = make_dataset(tmp / "data.jsonl", args.samples)

        renderer = Renderer(tok, "prefill", id_field="id")
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        ids = [renderer.render(r, i).input_ids for i, r in enumerate(rows)]
        batches = [ids[i : i + args.batch_size] for i in range(0, len(ids), args.batch_size)]

        results = {"baseline": [], "hsx": []}
        for rep in range(args.repeats):
            secs, tokens = baseline(model, batches)
            results["baseline"].append(tokens / secs)
            cfg = ExtractConfig(model=str(tmp / "model"), dataset=str(data), id_field="id", mode="prefill",
                                output=str(tmp / f"out{rep}"), layers="final", dtype="bfloat16",
                                batch_size=args.batch_size, model_dtype="float32")
            t0 = time.perf_counter()
            summary = extract(cfg, progress=False)
            secs = time.perf_counter() - t0
            assert summary.tokens == tokens, (summary.tokens, tokens)
            results["hsx"].append(summary.tokens / secs)

    best = {k: max(v) for k, v in results.items()}
    ratio = best["hsx"] / best["baseline"]
    report = {
        "samples": args.samples, "tokens": tokens, "hidden": args.hidden, "layers": args.layers,
        "batch_size": args.batch_size, "threads": torch.get_num_threads(),
        "tokens_per_s": results, "best_tokens_per_s": best, "ratio_hsx_to_baseline": ratio,
        "target": 0.85, "pass": ratio >= 0.85,
    }
    print(f"prefill, {args.samples} samples, {tokens:,} tokens, hidden {args.hidden}, {args.layers} layers, "
          f"batch {args.batch_size}, best of {args.repeats}")
    print(f"  bare transformers forward   {best['baseline']:>10,.0f} tokens/s")
    print(f"  hsx extract (I/O included)  {best['hsx']:>10,.0f} tokens/s")
    print(f"  ratio                       {ratio:>10.2f}x   (target >= 0.85: {'PASS' if ratio >= 0.85 else 'FAIL'})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
