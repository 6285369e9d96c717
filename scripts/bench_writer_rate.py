"""Can the shard writer keep up with a GPU? Rows at 8B widths pushed into ``BackgroundSink`` as fast as it takes them.

    python scripts/bench_writer_rate.py [--mb 1024] [--lanes 1,2] [--hidden 4096] [--codec planes-zstd]

A GPU running an 8B target with hsx's capture produces ``final`` (hidden) plus ``eagle3`` (3 x hidden)
per token: at hidden 4096 in bf16, 32 KiB a token; SpecForge's reported 27,000 prompt tokens/s is
about 0.9 GB/s. Here the engine is infinitely fast: samples of ``--tokens`` rows are handed to
``BackgroundSink`` (the pipeline's writer, default codec, fsync and manifest included) back to back
until ``--mb`` of raw rows went in, for each lane count. Reported per lane count: raw MB/s over the
whole run (first ``add`` to ``close``), the time ``add`` blocked (what the engine would have waited),
the process's CPU seconds and MB per CPU second (what a lane with a core of its own would do, the
figure that carries over from a shared machine), the cores that implies for 0.9 GB/s, and the share
of its time an engine producing 0.9 GB/s would wait at the measured wall rate. The rows are normal values with
per-channel scales (hidden states' few large channels), 8 distinct samples reused; real states
compress somewhat better (docs/STORAGE.md), so the codec's speed here is indicative.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hsx.shards import BackgroundSink, Manifest, Record, build_metadata

TARGET_BYTES_S = 0.9e9  # 27,000 tokens/s x (4096 + 3 x 4096) x 2 bytes


def samples(hidden: int, tokens: int, count: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(4 * hidden, generator=g))  # [4H] a few channels far larger than the rest
    out = []
    for _ in range(count):
        rows = (torch.randn(tokens, 4 * hidden, generator=g) * scale).to(torch.bfloat16)
        out.append({"final": rows[:, :hidden].contiguous(), "eagle3": rows[:, hidden:].contiguous()})
    return out


def run(lanes: int, pool, total: int, codec: str, root: Path) -> dict:
    hidden = pool[0]["final"].shape[1]
    meta = build_metadata(layers=[{"name": "final", "width": hidden}, {"name": "eagle3", "width": 3 * hidden}],
                          dtype="bfloat16", mode="prefill", codec=codec)
    out = root / f"lanes{lanes}"
    per_sample = sum(h.numel() * h.element_size() for h in pool[0].values())
    n = math.ceil(total / per_sample)
    tokens = pool[0]["final"].shape[0]
    ids, mask = torch.arange(tokens, dtype=torch.int32), torch.ones(tokens, dtype=torch.uint8)
    t, c = time.perf_counter(), time.process_time()
    sink = BackgroundSink(out, Manifest(meta), lanes=lanes)
    with sink:
        for i in range(n):
            sink.add(Record(f"s{i}", i, ids, 1, mask, "length", pool[i % len(pool)]))
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    written = sum(f.stat().st_size for f in out.iterdir())
    shutil.rmtree(out)
    return {"lanes": lanes, "raw_mb": n * per_sample / 1e6, "wall_s": wall, "cpu_s": cpu, "mb_s": n * per_sample / 1e6 / wall,
            "blocked_s": sink.stats.blocked_s, "on_disk": written / (n * per_sample)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="raw MB of rows per lane count")
    ap.add_argument("--lanes", default="1,2")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=550, help="rows per sample")
    ap.add_argument("--codec", default="planes-zstd")
    a = ap.parse_args()
    pool = samples(a.hidden, a.tokens)
    root = Path(tempfile.mkdtemp(prefix="hsx-bench-writer-"))
    try:
        for lanes in (int(x) for x in a.lanes.split(",")):
            r = run(lanes, pool, a.mb * 10**6, a.codec, root)
            per_core = r["raw_mb"] / r["cpu_s"]  # what a lane does with a core of its own
            print(f"[writer] {a.codec}, {lanes} lane(s): {r['raw_mb']:.0f} MB raw in {r['wall_s']:.1f} s = "
                  f"{r['mb_s']:.0f} MB/s, on disk {r['on_disk']:.2f}x raw, add blocked {r['blocked_s']:.1f} s "
                  f"({100 * r['blocked_s'] / r['wall_s']:.0f}% of the run), CPU {r['cpu_s']:.1f} s = {per_core:.0f} MB "
                  f"per CPU second; 0.9 GB/s needs {math.ceil(TARGET_BYTES_S / 1e6 / per_core)} cores at that rate, "
                  f"and at this wall rate the engine would wait {100 * max(0.0, 1 - r['mb_s'] * 1e6 / TARGET_BYTES_S):.0f}% "
                  "of its time", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
