"""One EAGLE3 training set from one real-SGLang run: ``hsx extract --engine sglang --spec-algorithm EAGLE3
--layers final,eagle3`` on the lane, then ``hsx verify``, then every row of both columns against the oracle.

Run inside the lane: ``bash scripts/sglang_cpu.sh python scripts/sglang_cpu/eagle3_extract.py``.
It builds the lane's target and EAGLE3 draft (:mod:`hsx.demo.spec_models`), extracts the demo prompts
with hsx's capture (SGLang's float-list builders made to raise: ``HSX_LANE_FORBID_LISTS=1``) and
checks: both columns in the shards, ``accept_lens`` int16 on every sample and consistent with its
tokens, every row within 1e-4 (relative to the largest oracle value) of a teacher-forced forward.
Exit 0 only if all of that holds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from oracle import oracle_sources  # noqa: E402

import hsx  # noqa: E402
from hsx.demo.spec_models import build_spec_models  # noqa: E402

TOLERANCE = 1e-4
CPU_ARGS = ["--device", "cpu", "--model-dtype", "float32", "--attention-backend", "torch_native",
            "--engine-arg", "sampling_backend=pytorch", "--engine-arg", "disable_cuda_graph=true",
            "--engine-arg", "mem_fraction_static=0.05", "--engine-arg", "max_total_tokens=16384",
            "--engine-arg", "context_length=1024", "--engine-arg", "sleep_on_idle=true"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path)
    ap.add_argument("--limit", type=int, default=12)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    work = args.work or Path(tempfile.mkdtemp(prefix="hsx-eagle3-"))
    models = build_spec_models(work / "models")
    out = work / "shards"
    cmd = ["hsx", "extract", "--engine", "sglang", "--spec-algorithm", "EAGLE3", "--layers", "final,eagle3",
           "--model", str(models.target), "--draft-model", str(models.eagle3),
           "--dataset", str(ROOT / "hsx" / "demo_data" / "prompts.jsonl"), "--id-field", "id",
           "--limit", str(args.limit), "--output", str(out), "--dtype", "float32", "--max-new-tokens", "24",
           "--batch-size", "6", "--spec-num-steps", "3", "--spec-topk", "2", "--spec-num-draft-tokens", "6",
           "--quiet", *CPU_ARGS]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HSX_LANE_FORBID_LISTS": "1"})
    print("$ hsx verify", out, flush=True)
    subprocess.run(["hsx", "verify", str(out)], check=True)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    ds = hsx.open(out)
    layers = {g["name"]: g for g in ds.metadata["layers"]}
    faults, rows, worst, steps = [], 0, {n: 0.0 for n in layers}, 0
    if sorted(layers) != ["eagle3", "final"]:
        faults.append(f"columns {sorted(layers)}, expected eagle3 and final")
    for s in ds:
        a = s.accept_lens
        decoded = len(s.input_ids) - s.prompt_len - 1
        if a is None or a.dtype != torch.int16 or int(a.sum()) < decoded or int(a.sum()) - int(a[-1]) >= max(decoded, 1):
            faults.append(f"{s.sample_id}: accept_lens {None if a is None else a.tolist()} for {decoded} decoded tokens")
            continue
        steps += a.numel()
        src = oracle_sources(model, s.input_ids)
        for name, g in layers.items():
            got = s.hidden(name).float()
            ref = torch.cat([src[b] for b in g["sources"]], -1)[: got.shape[0]]
            if got.shape[0] != len(s.input_ids) - 1:
                faults.append(f"{s.sample_id}: {got.shape[0]} rows of {name} for {len(s.input_ids)} tokens")
                continue
            err = float((got - ref).abs().max()) / float(ref.abs().max())
            worst[name] = max(worst[name], err)
            if err > TOLERANCE:
                faults.append(f"{s.sample_id}: column {name} off by {err:.2e} relative")
        rows += len(s.input_ids) - 1
    n = len(ds.sample_ids)
    print(f"[eagle3] {n} samples, {rows} rows per column, {steps} verify steps "
          f"(mean accept {sum(len(s.input_ids) - s.prompt_len - 1 for s in ds) / max(steps, 1):.2f}); "
          + ", ".join(f"{k} {layers[k]['sources']} worst {v:.2e}" for k, v in worst.items()))
    for f in faults[:10]:
        print(f"[eagle3] FAIL {f}")
    ok = not faults and n > 0
    print(f"[eagle3] {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
