"""kill -9 a writing run at random points, resume it each time, and compare with an uninterrupted run.

A writer process puts samples 0..N-1 (tiny: 2 to 4 tokens, width 8, rows drawn from a generator
seeded by the sample's index) through a ``ShardSink``, resuming from the output's manifest and
skipping the ids it has. The script runs it once uninterrupted, then again on a second output,
killing it with SIGKILL at up to ``--kills`` random moments (each uniform over twice the
uninterrupted run's duration over ``kills + 1``) and restarting it, until it finishes. It then checks that the second output holds
every sample exactly once, with the same tokens and bit-identical rows as the first, and that
``hsx verify`` passes.

    python scripts/kill_resume.py --samples 100000 --per-shard 100 --kills 8
    python scripts/kill_resume.py --samples 100000 --store s3://bucket/prefix   # endpoint from AWS_* variables
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRITER = r"""
import sys
import torch
torch.set_num_threads(1)
from hsx.shards import Manifest, Record, ShardSink, build_metadata, load_manifest
from hsx.shards.manifest import manifest_path
out, n, per_shard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
meta = build_metadata(codec="planes-zstd", layers=[{"name": "final", "sources": [4], "width": 8, "raw_ids": None,
                      "rule": "kill test"}], dtype="bfloat16", mode="prefill",
                      model={"path": "kill-test", "num_layers": 4, "hidden_size": 8},
                      engine={"name": "kill-test", "version": "0"}, dataset={"path": "kill-test", "fingerprint": "0"})
m = load_manifest(out) if manifest_path(out).is_file() else Manifest(meta, config_hash="kill-test")
done = m.done_ids()
sink = ShardSink(out, m, max_shard_samples=per_shard)
print("ready", flush=True)
for i in range(n):
    if f"train:{i}" in done:
        continue
    k = 2 + i % 3
    rows = torch.randn(k, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
    sink.add(Record(f"train:{i}", i, torch.arange(k) + i % 1000, 1, torch.ones(k, dtype=torch.uint8), "stop",
                    {"final": rows}))
sink.close()
"""


def run_writer(out: str, n: int, per_shard: int, kill_after: float | None) -> bool:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, out, str(n), str(per_shard)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"the writer did not start:\n{proc.stderr.read()[-3000:]}")
    if kill_after is not None:
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    if proc.returncode not in (0, -signal.SIGKILL):
        raise SystemExit(f"the writer failed ({proc.returncode}):\n{err[-3000:]}")
    return proc.returncode == 0


def compare(got: str, want: str) -> None:
    import hsx
    import torch
    from hsx.shards import load_manifest
    from hsx.shards.verify import verify

    a, b = hsx.open(got), hsx.open(want)
    if len(a.sample_ids) != len(set(a.sample_ids)) or sorted(a.sample_ids) != sorted(b.sample_ids):
        raise SystemExit(f"FAILED: {len(a.sample_ids):,} samples, {len(set(a.sample_ids)):,} distinct; "
                         f"the uninterrupted run has {len(b.sample_ids):,}")
    for s, t in zip(a, b):  # both in source order
        if s.sample_id != t.sample_id or not torch.equal(s.input_ids, t.input_ids) or not torch.equal(
                s.hidden("final").view(torch.int16), t.hidden("final").view(torch.int16)):
            raise SystemExit(f"FAILED: sample {s.sample_id} differs from the uninterrupted run's")
    report = verify(got)
    if not report.ok or not load_manifest(got).complete:
        raise SystemExit(f"FAILED: verify: {report}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", default=None, help="s3://BUCKET/PREFIX for the killed run (default: a temp folder)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-kill-"))
    whole = str(work / "whole")
    t0 = time.perf_counter()
    run_writer(whole, args.samples, args.per_shard, None)
    duration = time.perf_counter() - t0
    killed = f"{args.store.rstrip('/')}/killed-{int(time.time())}" if args.store else str(work / "killed")
    rng, kills, runs = random.Random(args.seed), 0, 0
    while True:
        runs += 1
        # about duration / (kills + 1) apart: most runs are killed before the work is done
        delay = rng.uniform(0, 2 * duration / (args.kills + 1)) if kills < args.kills else None
        if run_writer(killed, args.samples, args.per_shard, delay):
            break
        kills += 1
        print(f"killed after {delay:.1f} s", flush=True)
    compare(killed, whole)
    print(f"OK: {args.samples:,} samples, killed {kills} times (kill -9) in {runs} runs, every sample exactly once "
          f"and bit-identical to the uninterrupted run ({duration:.0f} s); {killed}")


if __name__ == "__main__":
    main()
