"""Benchmark `hsx export speculators` and `hsx export saelens` against reading the same rows: MB/s and peak memory.

  read         ``hsx.open(d)``, every sample's columns touched (``.sum()`` of each row block): the baseline
  speculators  ``export_speculators`` (one safetensors file per sample + the Arrow dataset)
  saelens      ``export_saelens`` of one column, contexts of 128 rows

Synthetic bf16 shards of a 4-block model (columns b1, b2, b3, b4; width W) are written twice, the
full size and a quarter, and each method runs in a fresh process on each, so that the peak
resident memory it adds (VmHWM after minus before, imports excluded) shows whether it grows with
the data; both exports are meant to hold about one block plus two open shards.

    python scripts/bench_export.py                   # ~200 MB of bf16 rows, W = 1024
    python scripts/bench_export.py --mb 800 --json bench_out/bench_export.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import hsx, datasets, safetensors.torch, pyarrow
from hsx.export import export_saelens, export_speculators
d, how, out = sys.argv[1], sys.argv[2], sys.argv[3]
def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
pyarrow.array([1]).to_numpy()
before = peak()
t0 = time.perf_counter()
if how == "read":
    total = 0.0
    for s in hsx.open(d, cache_shards=2):
        for c in ("b1", "b2", "b3", "b4"):
            total += float(s.hidden(c).float().sum())
elif how == "speculators":
    export_speculators(d, out, target_layer_ids=[1, 2, 3], progress=False)
else:
    export_saelens(d, out, column="b2", context_size=128, progress=False)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "peak_mb": (peak() - before) / 1024}))
"""


def write_data(d: Path, mb: float, width: int, seed: int) -> int:
    import numpy as np
    import torch

    from hsx.shards import Manifest, Record, ShardSink, build_metadata

    layers = [{"name": f"b{b}", "sources": [b], "width": width, "raw_ids": [b], "rule": "boundary"} for b in (1, 2, 3, 4)]
    meta = build_metadata(layers=layers, dtype="bfloat16", mode="prefill",
                          model={"path": "bench", "num_layers": 4, "hidden_size": width},
                          engine={"name": "bench"}, dataset={"source": "bench"})
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    sink = ShardSink(d, Manifest(meta), max_shard_bytes=64 << 20, row_group_bytes=16 << 20)
    total, i = 0, 0
    while total < mb * 1e6:
        n = int(rng.integers(100, 500))
        hidden = {f"b{b}": torch.randn(n, width, generator=gen).bfloat16() for b in (1, 2, 3, 4)}
        sink.add(Record(f"s{i}", i, torch.arange(n) % 1000, n, torch.ones(n, dtype=torch.uint8), "prefill", hidden))
        total, i = total + 4 * n * width * 2, i + 1
    sink.close()
    return total


def run(d: Path, how: str, out: Path) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, str(d), how, str(out)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{how} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200, help="raw bf16 megabytes of the full data set (4 columns)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "bench_export.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-export-"))
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    try:
        for label, mb in (("full", args.mb), ("quarter", args.mb / 4)):
            d = work / label
            raw = write_data(d, mb, args.width, seed=1)
            for how in ("read", "speculators", "saelens"):
                r = run(d, how, work / f"{label}-{how}")
                r.update(data=label, data_mb=raw / 1e6, method=how, mb_per_s=raw / 1e6 / r["seconds"])
                report["runs"].append(r)
                shutil.rmtree(work / f"{label}-{how}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'method':<12} {'data':>8} {'seconds':>8} {'MB/s':>8} {'vs read':>8} {'peak MB':>8}")
    base = {r["data"]: r["seconds"] for r in report["runs"] if r["method"] == "read"}
    for r in report["runs"]:
        print(f"{r['method']:<12} {r['data_mb']:>6.0f}MB {r['seconds']:>8.2f} {r['mb_per_s']:>8.0f} "
              f"{base[r['data']] / r['seconds']:>7.2f}x {r['peak_mb']:>8.0f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
