"""Benchmark ``hsx.tokens_loader`` against ``ds.tokens()`` on the same shards: rows/s and peak memory.

  tokens()        ``hsx.open(d).tokens("final")`` (every row in one matrix), then shuffled batches
                  gathered from it with a random permutation: the in-memory baseline
  loader          ``hsx.tokens_loader(d, batch_size, shuffle_buffer)`` iterated in this process
  loader x2       the same through ``DataLoader(num_workers=2)``

Each method runs in a fresh process, on the full data set and on a quarter of it, so that the
peak resident memory it adds (ru_maxrss after minus before, imports excluded; for ``loader x2``
the largest worker's whole peak, imports included) shows whether it grows with the data; the
loader's is bounded by its shuffle buffer and a few samples being decoded. Every method must yield every row once.

    python scripts/bench_loader.py                 # ~200 MB of bf16 rows, W = 1024
    python scripts/bench_loader.py --mb 800 --json bench_out/bench_loader.json
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
import json, resource, sys, time
import torch
torch.set_num_threads(1)
import hsx, hsx.shards.loader, pyarrow, pyarrow.parquet
from torch.utils.data import DataLoader
d, how, batch, buffer = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def peak(who=None):
    # this process's own peak: ru_maxrss would carry a large forking parent's over exec
    if who is not None:
        return resource.getrusage(who).ru_maxrss
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
pyarrow.array([1]).to_numpy()  # pyarrow imports pandas on first use: not the method's memory
before = peak()
t0 = time.perf_counter()
seen = 0
keys = []
if how == "tokens":
    tm = hsx.open(d).tokens("final")
    order = torch.randperm(tm.hidden.shape[0], generator=torch.Generator().manual_seed(0))
    for i in range(0, order.numel(), batch):
        idx = order[i:i + batch]
        x = tm.hidden[idx]  # [B, W] a gathered copy, as a training step would get it
        seen += x.shape[0]
        keys.append(tm.sample_index[idx] * 1_000_000 + tm.position[idx])
else:
    loader = hsx.tokens_loader(d, columns=["final"], batch_size=batch, shuffle_buffer=buffer, seed=0)
    it = DataLoader(loader, batch_size=None, num_workers=2) if how == "loader x2" else loader
    for b in it:
        seen += b["final"].shape[0]
        keys.append(b["sample_index"] * 1_000_000 + b["position"])
seconds = time.perf_counter() - t0
k = torch.cat(keys)
# loader x2: the largest worker's whole peak (what a forked worker shares with its parent cannot be
# told apart from what it allocated)
grown = (peak() - before) if how != "loader x2" else peak(resource.RUSAGE_CHILDREN)
print(json.dumps({"rows": seen, "unique": int(k.unique().numel()), "seconds": seconds, "peak_mb": grown / 1024}))
"""


def write_data(d: Path, mb: float, width: int, seed: int) -> int:
    import numpy as np
    import torch

    from hsx.shards import Manifest, Record, ShardSink, build_metadata

    layer = {"name": "final", "sources": ["final"], "width": width, "raw_ids": None, "rule": "bench"}
    meta = build_metadata(layers=[layer], dtype="bfloat16", mode="prefill", model={"path": "bench"},
                          engine={"name": "bench"}, dataset={"source": "bench"})
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    sink = ShardSink(d, Manifest(meta), max_shard_bytes=64 << 20, row_group_bytes=16 << 20)
    total, i = 0, 0
    while total < mb * 1e6:
        n = int(rng.integers(100, 500))
        h = torch.randn(n, width, generator=gen).bfloat16()
        sink.add(Record(f"s{i}", i, torch.arange(n) % 1000, 1, torch.ones(n, dtype=torch.uint8), "prefill", {"final": h}))
        total, i = total + h.numel() * 2, i + 1
    sink.close()
    return total


def run(d: Path, how: str, batch: int, buffer: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(d), how, str(batch), str(buffer)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200, help="raw bf16 megabytes of the full data set")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--shuffle-buffer", type=int, default=8192,
                    help="rows; peak memory is flat in the data size once both data sets exceed it")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_out" / "bench_loader.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hsx-bench-loader-"))
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    try:
        for label, mb in (("full", args.mb), ("quarter", args.mb / 4)):
            d = work / label
            raw = write_data(d, mb, args.width, seed=1)
            for how in ("tokens", "loader", "loader x2"):
                r = run(d, how, args.batch_size, args.shuffle_buffer)
                r.update(data=label, data_mb=raw / 1e6, method=how, rows_per_s=r["rows"] / r["seconds"])
                assert r["unique"] == r["rows"], f"{how}: rows repeated or lost"
                report["runs"].append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'method':<11} {'data':>8} {'rows':>9} {'rows/s':>10} {'vs tokens()':>11} {'peak MB':>8}")
    base = {r["data"]: r["rows_per_s"] for r in report["runs"] if r["method"] == "tokens"}
    for r in report["runs"]:
        print(f"{r['method']:<11} {r['data_mb']:>6.0f}MB {r['rows']:>9,} {r['rows_per_s']:>10,.0f} "
              f"{r['rows_per_s'] / base[r['data']]:>10.2f}x {r['peak_mb']:>8.0f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
