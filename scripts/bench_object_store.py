"""Write and read speed of an output in an S3-compatible store against local disk, in the same run.

A SeaweedFS server (tests/s3_server.py, from the test extra) is started on 127.0.0.1 with its data
directory on the same disk as the local output. The same records (random bf16 rows, W = 1024,
samples of 200-600 rows) go through ``BackgroundSink`` (the extract's writer: lanes, shard
commits, manifest saves) into ``DIR`` and into ``s3://BUCKET/bench``; then ``hsx.open`` reads every
sample's rows back from each, and ``hsx.tokens_loader`` makes one pass over each (the store's with
its read-ahead of 2 batches, and without: ``read_ahead=0``). MB/s are the raw bytes of the hidden rows per second; each side runs
``--repeats`` times, alternating, after an untimed warm-up of each, and the median is kept. The store's figures are also given as a
ratio of local disk's, measured minutes apart on the same machine.

    python scripts/bench_object_store.py                      # 256 MB, codecs none and planes-zstd
    python scripts/bench_object_store.py --mb 64 --repeats 1 --json bench_out/bench_object_store.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WIDTH = 1024


def make_records(mb: int, seed: int = 0):
    import numpy as np
    import torch

    from hsx.shards import Record

    rng = np.random.default_rng(seed)
    records, total, i = [], 0, 0
    while total < mb << 20:
        rows = int(rng.integers(200, 600))
        bits = rng.integers(0, 2**16, size=(rows, WIDTH), dtype=np.uint16).view(np.int16)
        hidden = torch.from_numpy(bits).view(torch.bfloat16)
        ids = torch.from_numpy(rng.integers(0, 2048, size=rows + 1))
        records.append(Record(f"s{i:06d}", i, ids, 1, torch.ones(rows + 1, dtype=torch.uint8), "length",
                              {"final": hidden}, None, 0))
        total += hidden.numel() * 2
        i += 1
    return records, total


def metadata(codec: str) -> dict:
    from hsx.shards import build_metadata

    return build_metadata(codec=codec, layers=[{"name": "final", "sources": [4], "width": WIDTH, "raw_ids": None,
                                                "rule": "bench"}],
                          dtype="bfloat16", mode="generate", model={"path": "bench", "num_layers": 4,
                                                                    "hidden_size": WIDTH},
                          engine={"name": "bench", "version": "0"}, dataset={"path": "memory", "fingerprint": "0"})


def write(out, records, codec: str) -> float:
    from hsx.shards import BackgroundSink, Manifest

    t0 = time.perf_counter()
    with BackgroundSink(out, Manifest(metadata(codec)), max_shard_bytes=64 << 20) as sink:
        for r in records:
            sink.add(r)
    return time.perf_counter() - t0


def read(out) -> tuple[float, int]:
    import hsx

    t0 = time.perf_counter()
    ds = hsx.open(out)
    n = 0
    for s in ds:
        n += s.hidden("final").numel() * 2
    return time.perf_counter() - t0, n


def loader_pass(out, read_ahead: int) -> tuple[float, int]:
    """One pass of ``hsx.tokens_loader`` in storage order (the store: ranged reads, ``read_ahead`` batches ahead)."""
    import hsx

    t0 = time.perf_counter()
    n = 0
    for batch in hsx.tokens_loader(out, batch_size=4096, shuffle_buffer=0, read_ahead=read_ahead):
        n += batch["final"].numel() * 2
    return time.perf_counter() - t0, n


def clear(out) -> None:
    from hsx.storage.store import as_path

    path = as_path(out)
    if isinstance(path, Path):
        shutil.rmtree(path, ignore_errors=True)
        return
    for p in list(path.iterdir()):
        p.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="raw MB of hidden rows written per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--codecs", default="none,planes-zstd")
    ap.add_argument("--dir", default=None, help="where the local output and the store's data go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from s3_server import S3Server

    root = Path(tempfile.mkdtemp(prefix="hsx-bench-store-", dir=args.dir))
    server = S3Server(root / "store").start()
    os.environ.update(server.env())
    results = []
    try:
        records, raw = make_records(args.mb)
        for codec in args.codecs.split(","):
            places = {"local disk": str(root / "local"), "object store": f"s3://{server.bucket}/bench"}
            kinds = ("write", "read", "loader", "loader_no_ahead")
            timing = {name: {k: [] for k in kinds} for name in places}
            for out in places.values():  # warm-up, not timed: imports, the store's first connections
                clear(out)
                write(out, records[:8], codec)
                read(out)
            for _ in range(args.repeats):
                for name, out in places.items():
                    clear(out)
                    timing[name]["write"].append(write(out, records, codec))
                    seconds, read_bytes = read(out)
                    assert read_bytes == raw, (name, read_bytes, raw)
                    timing[name]["read"].append(seconds)
                    for kind, ahead in (("loader", 2), ("loader_no_ahead", 0)):
                        seconds, read_bytes = loader_pass(out, ahead)
                        assert read_bytes == raw, (name, kind, read_bytes, raw)
                        timing[name][kind].append(seconds)
            base = {k: statistics.median(timing["local disk"][k]) for k in kinds}
            for name in places:
                med = {k: statistics.median(timing[name][k]) for k in kinds}
                row = {"codec": codec, "where": name, "raw_mb": raw / 1e6}
                for k in kinds:
                    row[f"{k}_mb_s"] = raw / 1e6 / med[k]
                    row[f"{k}_x_local"] = base[k] / med[k]
                    row[f"{k}_s"] = timing[name][k]
                results.append(row)
                print(f"{codec:12s} {name:13s}" + "".join(f"  {k} {row[k + '_mb_s']:7.1f} MB/s ({row[k + '_x_local']:.2f}x)"
                                                         for k in kinds), flush=True)
            clear(places["object store"])
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"mb": args.mb, "repeats": args.repeats, "results": results}, indent=1))


if __name__ == "__main__":
    main()
