"""How hsx's own costs grow with a run's size: seconds and peak RSS per step, per sample, at several sizes.

Tiny samples (2 to 4 tokens, one hidden column of width 8) in many small shards, so that what grows is
hsx's bookkeeping (manifest commits, resume, opening), not the model or the bytes. Steps, each in a
fresh process (its peak resident memory is VmHWM, imports included):

  write       ShardSink over every sample, one commit per shard (``--per-shard`` samples a shard): the
              extract's writing and committing, without a model
  commits     the manifest alone: ``save_manifest`` once per shard entry (no shard files), the cost
              a run's commits add; cheap enough to run at 1M samples on a small machine
  rerun       what a rerun over the complete output does before any model: load the manifest, the set
              of done ids, a sink on it, close
  open        ``hsx.open``
  random      1,000 random ``ds[i]`` on an open output (its time per access, not per sample)
  inspect     ``hsx inspect``'s summary (small columns of every shard)
  verify      ``hsx verify`` (every shard read and checked)

    python scripts/bench_scale.py --samples 10000 100000               # local disk
    python scripts/bench_scale.py --samples 10000 --store s3://bucket/prefix   # endpoint from AWS_* variables
    python scripts/bench_scale.py --samples 1000000 --steps commits    # the manifest alone at 1M
    PYTHONPATH=/path/to/older/hsx python scripts/bench_scale.py ...    # the same steps on another hsx

Prints one table (seconds, microseconds per sample, peak RSS, and the bytes the step handed to
``write(2)``, from ``/proc/self/io``: unlike seconds, they do not depend on the disk's load) and writes
it as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = ("write", "commits", "rerun", "open", "random", "inspect", "verify")

CHILD = r"""
import json, random, sys, time
import torch
torch.set_num_threads(1)
import hsx
from hsx.shards import Manifest, Record, ShardEntry, ShardSink, build_metadata, load_manifest
from hsx.shards.manifest import save_manifest
from hsx.shards.verify import inspect, verify
step, out, n, per_shard = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def written():  # bytes this process handed to write(2): shards, manifest, everything
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))

def peak_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

meta = build_metadata(codec="planes-zstd", layers=[{"name": "final", "sources": [4], "width": 8, "raw_ids": None,
                      "rule": "bench"}], dtype="bfloat16", mode="prefill",
                      model={"path": "bench", "num_layers": 4, "hidden_size": 8},
                      engine={"name": "bench", "version": "0"}, dataset={"path": "bench", "fingerprint": "0"})
hidden = torch.randn(4, 8).to(torch.bfloat16)

def record(i):
    k = 2 + i % 3
    return Record(f"train:{i}", i, torch.arange(k) + i % 1000, 1, torch.ones(k, dtype=torch.uint8), "stop",
                  {"final": hidden[:k]})

w0, t0 = written(), time.perf_counter()
if step == "write":
    sink = ShardSink(out, Manifest(meta, config_hash="bench"), max_shard_samples=per_shard)
    for i in range(n):
        sink.add(record(i))
    sink.close()
elif step == "commits":
    from pathlib import Path
    Path(out).mkdir(parents=True, exist_ok=True)
    m = Manifest(meta, config_hash="bench")
    save_manifest(out, m)
    for k in range(n // per_shard):
        ids = [f"train:{i}" for i in range(k * per_shard, (k + 1) * per_shard)]
        m.shards.append(ShardEntry(f"shard-{k:05d}.parquet", per_shard, 3 * per_shard, 3 * per_shard, 4000,
                                   "0" * 32, ids, list(range(k * per_shard, (k + 1) * per_shard))))
        save_manifest(out, m)
    m.complete = True
    save_manifest(out, m)
elif step == "rerun":
    m = load_manifest(out)
    done = m.done_ids()
    assert len(done) == n
    ShardSink(out, m, max_shard_samples=per_shard).close()
elif step == "open":
    assert len(hsx.open(out)) == n
elif step == "random":
    ds = hsx.open(out)
    rng = random.Random(0)
    t0 = time.perf_counter()
    for _ in range(1000):
        s = ds[rng.randrange(len(ds))]
        assert s.hidden("final").shape[1] == 8
elif step == "inspect":
    assert inspect(out)["samples"] == n
elif step == "verify":
    assert verify(out).ok
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": peak_kb() / 1024, "written_mb": (written() - w0) / 2**20}))
"""


def run_step(step: str, out: str, n: int, per_shard: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # run from the temp folder: ``python -c`` puts its working directory first on sys.path, and a checkout's
    # hsx there would shadow the one PYTHONPATH names
    proc = subprocess.run([sys.executable, "-c", CHILD, step, out, str(n), str(per_shard)], capture_output=True,
                          text=True, env=env, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"{step} at {n:,} samples failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def location(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if base.startswith("s3://") else str(Path(base) / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--per-shard", type=int, default=10, help="samples a shard (default 10: many shards)")
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    ap.add_argument("--store", default=None, help="s3://BUCKET/PREFIX, or a local folder (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    base = args.store or tempfile.mkdtemp(prefix="hsx-bench-scale-")
    rows = []
    try:
        for n in args.samples:
            out = location(base, f"n{n}-{int(time.time())}")
            for step in args.steps:
                target = location(base, f"n{n}-commits-{int(time.time())}") if step == "commits" else out
                r = run_step(step, target, n, args.per_shard)
                per = 1000 if step == "random" else n  # random: per access
                rows.append({"step": step, "samples": n, "shards": -(-n // args.per_shard), **r,
                             "us_per_sample": 1e6 * r["seconds"] / per})
                print(f"{step:8s} {n:>10,} samples {rows[-1]['shards']:>8,} shards  {r['seconds']:9.2f} s  "
                      f"{rows[-1]['us_per_sample']:9.1f} us/sample  peak {r['peak_mb']:7.0f} MB  "
                      f"written {r['written_mb']:9.1f} MB", flush=True)
    finally:
        if args.store is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
