"""How far clean rows are from the recompute, and what the recompute costs against extraction.

    .venv/bin/python scripts/bench_recompute.py MODEL_DIR [--draft DIR] [--mode generate|prefill] [--limit N]

Extracts the demo prompts with the transformers engine, computing in float32 and in bfloat16
and storing float32 and bfloat16, then runs the recompute in float32 and in bfloat16 over each
output. Prints the worst per-row relative error and cosine per (engine compute, stored, recompute)
dtypes and per column source, and the recompute's rows/s against extraction's on the same
shards; writes bench_out/recompute-<model>-<mode>.json. These numbers are where the tolerance's
measured terms (hsx/compare/tolerance.py) come from.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hsx.config import ExtractConfig
from hsx.run.pipeline import extract
from hsx.recompute import recompute

ROOT = Path(__file__).resolve().parents[1]
RUNS = [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16")]  # (engine compute, stored)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--draft")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--mode", default="generate", choices=["generate", "prefill"])
    ap.add_argument("--runs", default="all", choices=["all", "float32"], help="float32: only the float32 extraction")
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    args = ap.parse_args()
    from transformers import AutoConfig

    num_layers = AutoConfig.from_pretrained(args.model).num_hidden_layers
    out = Path(args.out)
    rows = []
    for compute, stored in RUNS if args.runs == "all" else RUNS[:1]:
        d = out / f"recompute-shards-{args.mode}-{compute}-{stored}"
        cfg = ExtractConfig(model=args.model, draft_model=args.draft if args.mode == "generate" else None, dataset=str(ROOT / "hsx/demo_data/prompts.jsonl"),
                            id_field="id", output=str(d), layers=f"final,eagle3,0,{num_layers}", dtype=stored,
                            model_dtype=compute, mode=args.mode, max_new_tokens=args.max_new_tokens, limit=args.limit, batch_size=8,
                            **({"spec_num_steps": 3, "spec_topk": 1, "spec_num_draft_tokens": 4}
                               if args.draft and args.mode == "generate" else {}))
        t0 = time.perf_counter()
        run = extract(cfg, overwrite=True, progress=False)
        extract_s = time.perf_counter() - t0
        for recompute_dtype in ("float32", "bfloat16"):
            r = recompute(d, device="cpu", dtype=recompute_dtype, progress=False)
            row = {"engine_compute": compute, "stored": stored, "recompute": recompute_dtype, "ok": r.ok,
                   "limit_rel": r.tolerance["rel"], "worst_rel": max(s.worst_rel for s in r.sources),
                   "worst_cos": min(s.worst_cos for s in r.sources), "rows": r.rows, "tokens": run.tokens,
                   "extract_s": extract_s, "recompute_s": r.seconds, "recompute_load_s": r.load_seconds,
                   "extract_rows_per_s": run.rows / extract_s, "recompute_rows_per_s": r.rows_per_s,
                   "recompute_check_rows_per_s": r.check_rows_per_s,
                   "per_source": {f"{s.column}:{s.source}": [s.worst_rel, s.mean_rel, s.worst_cos] for s in r.sources}}
            rows.append(row)
            print(f"engine {compute:>8} stored {stored:>8} recompute {recompute_dtype:>8}: worst rel {row['worst_rel']:.3g} "
                  f"(limit {row['limit_rel']:.3g}) worst cos {row['worst_cos']:.6f} ok={r.ok}; {r.rows} rows: extract "
                  f"{row['extract_rows_per_s']:,.0f} rows/s, recompute {row['recompute_rows_per_s']:,.0f} rows/s "
                  f"({row['recompute_check_rows_per_s']:,.0f} after {r.load_seconds:.1f} s loading)")
            for key, (worst, mean, cos) in row["per_source"].items():
                print(f"    {key:<14} worst rel {worst:.3g}  mean rel {mean:.3g}  worst cos {cos:.6f}")
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    (out / f"recompute-{name}-{args.mode}.json").write_text(json.dumps({"model": args.model, "num_layers": num_layers,
                                                            "threads": torch.get_num_threads(), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
