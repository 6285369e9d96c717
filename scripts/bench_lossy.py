"""What the lossy stored dtypes cost: bytes on disk, error against float32 states, and two downstream uses.

    python scripts/bench_lossy.py [--work DIR] [--out bench_out/lossy.json] [--steps 300]

1. SmolLM2-135M-Instruct (hsx.demo.pretrained), ``final,eagle3``, the 40 demo chats in prefill mode,
   one extract per ``--dtype`` (float32 as the reference, bfloat16, int8, float8_e4m3; the CPU engine
   is deterministic, so every run computes the same float32 states): shard bytes per token, and per
   column the mean and max relative row error ``|stored - float32| / |float32|`` over every row.
2. A linear probe (hsx.analysis.probe_layers, as notebooks/analysis.ipynb: "next token starts a new
   word") on each SmolLM2 run's states: held-out accuracy per layer.
3. An EAGLE3 head (scripts/train_eagle3_demo.py, the same steps and seed) trained on the demo target's
   shards (hsx.demo.build, generate mode as scripts/demo.sh), one extract per dtype: held-out top-1
   agreement with the target; with ``--acceptance`` each head then drafts for the target (the
   transformers engine, chain speculation) on its held-out prompts: mean tokens per verify step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import hsx  # noqa: E402
from hsx import analysis as A  # noqa: E402
from hsx.config import ExtractConfig  # noqa: E402
from hsx.demo.pretrained import smollm2_checkpoint  # noqa: E402
from hsx.run.pipeline import extract  # noqa: E402
from hsx.shards.manifest import MANIFEST, load_manifest  # noqa: E402

DATA = ROOT / "hsx" / "demo_data" / "prompts.jsonl"
DTYPES = ["bfloat16", "int8", "float8_e4m3"]


def run_extract(out: Path, dataset_override: str | None = None, **cfg) -> float:
    t0 = time.perf_counter()
    manifest = load_manifest(out) if (out / MANIFEST).exists() else None
    if manifest is None or not manifest.complete:  # a complete run is reused
        extract(ExtractConfig(dataset=dataset_override or str(DATA), id_field="id", output=str(out), **cfg),
                progress=False)
    return time.perf_counter() - t0


def shard_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("shard-*.parquet"))


def row_errors(ds, ref) -> dict:
    out = {}
    for name in ref.columns:
        want = ref.tokens(name).hidden.double()
        got = ds.tokens(name).hidden.double()
        rel = (got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
        out[name] = {"mean": rel.mean().item(), "max": rel.max().item(), "rows": int(rel.numel())}
    return out


def probe(ds, tokenizer) -> dict:
    table = A.token_table(ds, tokenizer)
    has_next = table["next_token_id"].to_numpy() >= 0
    positive = A.starts_with_space(table["next_token"]).to_numpy()
    labels = np.where(has_next, positive, -1)
    res = A.probe_layers(ds, labels, table=table)
    return {str(r["layer"]): {"accuracy": float(r["accuracy"]), "baseline": float(r["baseline"]),
                              "majority": float(r["majority"]), "n_test": int(r["n_test"])}
            for _, r in res.iterrows()}


def smollm2(work: Path) -> dict:
    from transformers import AutoTokenizer

    model = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(model)
    runs = {}
    for dtype in ["float32", *DTYPES]:
        out = work / "smollm2" / dtype
        seconds = run_extract(out, model=str(model), mode="prefill", layers="final,eagle3", dtype=dtype)
        ds = hsx.open(out)
        tokens = sum(len(s.input_ids) for s in ds)
        runs[dtype] = {"extract_seconds": round(seconds, 1), "tokens": tokens, "bytes": shard_bytes(out),
                       "bytes_per_token": shard_bytes(out) / tokens}
    ref = hsx.open(work / "smollm2" / "float32")
    for dtype in runs:
        ds = hsx.open(work / "smollm2" / dtype)
        runs[dtype]["row_error"] = row_errors(ds, ref)
        runs[dtype]["probe"] = probe(ds, tok)
    return runs


def eagle3(work: Path, steps: int, accept: bool) -> dict:
    import train_eagle3_demo as T
    from hsx.demo.build import build_demo

    models = work / "demo" / "models"
    if not (models / "target" / "config.json").exists():
        build_demo(models)
    runs = {}
    for dtype in DTYPES:
        out = work / "demo" / dtype
        run_extract(out, model=str(models / "target"), draft_model=str(models / "draft"), layers="final,eagle3,0,8",
                    mode="generate", max_new_tokens=48, batch_size=8, spec_num_steps=3, spec_topk=1,
                    spec_num_draft_tokens=4, dtype=dtype)
        head = work / "demo" / f"head-{dtype}"
        r = T.run(str(out), steps=steps, log_every=10**9, save_head=str(head) if accept else None)
        ho = r["held_out_top1"]
        runs[dtype] = {"held_out_top1": ho["trained"], "untrained": ho["untrained"], "constant_guess": ho["constant_guess"],
                       "train_top1": r["train_top1"]["trained"], "loss_last": r["loss"]["last"],
                       "held_out_samples": r["samples"]["held_out"], "steps": steps, "seconds": round(r["seconds"], 1),
                       "bytes_per_token": shard_bytes(out) / sum(len(s.input_ids) for s in hsx.open(out))}
        if accept:
            runs[dtype]["as_draft"] = draft_acceptance(work, models, head, r["samples"]["held_out_ids"], dtype)
    return runs


def draft_acceptance(work: Path, models: Path, head: Path, held_out: list[str], dtype: str) -> dict:
    """The trained head as the draft of the transformers engine (chain, 3 steps) on the held-out prompts."""
    prompts = work / "demo" / "heldout.jsonl"
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows if r["id"] in set(held_out)))
    out = work / "demo" / f"drafted-{dtype}"
    run_extract(out, model=str(models / "target"), draft_model=str(head), layers="final", mode="generate",
                max_new_tokens=48, batch_size=8, spec_num_steps=3, spec_topk=1, spec_num_draft_tokens=4,
                dataset_override=str(prompts))
    steps = np.concatenate([s.accept_lens.numpy() for s in hsx.open(out) if s.accept_lens is not None])
    return {"mean_accept_len": float(steps.mean()), "verify_steps": int(steps.size), "samples": len(held_out)}


def table(result: dict) -> str:
    sm, e3 = result["smollm2"], result["eagle3_demo"]
    base = sm["bfloat16"]["bytes_per_token"]
    lines = ["| stored dtype | bytes/token (SmolLM2 final+eagle3) | vs bf16 | rel. row error final: mean / max | "
             "eagle3: mean / max | probe acc. final | EAGLE3 head held-out top-1 (demo) | as draft: tokens/step |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype in ["float32", *DTYPES]:
        r = sm[dtype]
        fe, ee = r["row_error"]["final"], r["row_error"]["eagle3"]
        head = e3.get(dtype, {}).get("held_out_top1", {}).get("top1")
        drafted = e3.get(dtype, {}).get("as_draft", {}).get("mean_accept_len")
        lines.append(f"| {dtype} | {r['bytes_per_token']:,.0f} | {r['bytes_per_token'] / base:.2f}x | "
                     f"{fe['mean']:.2e} / {fe['max']:.2e} | {ee['mean']:.2e} / {ee['max']:.2e} | "
                     f"{r['probe']['final']['accuracy']:.4f} | {'-' if head is None else f'{head:.4f}'} | "
                     f"{'-' if drafted is None else f'{drafted:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="bench_out/lossy_work", help="where the extracts go (kept: a rerun reuses them)")
    p.add_argument("--out", default="bench_out/lossy.json")
    p.add_argument("--steps", type=int, default=300, help="EAGLE3 head training steps")
    p.add_argument("--acceptance", action="store_true", help="also draft with each trained head on its held-out prompts")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    work = Path(a.work)
    t0 = time.perf_counter()
    result = {"smollm2": smollm2(work), "eagle3_demo": eagle3(work, a.steps, a.acceptance)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(table(result))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
