"""Throughput of the online feed (``hsx.stream``) against ``hsx extract`` on the same prompts.

    python scripts/bench_stream.py [--config scripts/demo_run.toml] [--repeats 3] [--mode generate|prefill]

In one process, alternating (the side that goes first swaps every repeat): ``extract`` of the config
into a fresh temporary output, and one pass of a fresh :class:`hsx.feed.Feed` over the same config
whose consumer only counts rows. Both sides include loading the dataset and the engine. Reported:
tokens/s of each side per repeat and the ratio stream / extract (median over repeats); the two
sides must give the same samples, tokens and rows. JSON goes to ``bench_out/bench_stream.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import hsx
from hsx.config import ExtractConfig
from hsx.pipeline import extract


def time_extract(cfg: ExtractConfig, out: Path) -> dict:
    t0 = time.perf_counter()
    s = extract(dataclasses.replace(cfg, output=str(out)), progress=False)
    seconds = time.perf_counter() - t0
    if s.resumed:
        raise SystemExit(f"extract resumed {s.resumed} samples from {out}; each repeat needs an empty output")
    return {"seconds": seconds, "samples": s.samples, "tokens": s.tokens, "rows": s.rows, "errors": s.errors}


def time_stream(cfg: ExtractConfig, ahead: int) -> dict:
    t0 = time.perf_counter()
    feed = hsx.stream(cfg, ahead=ahead)
    rows = sum(r.num_rows for r in feed.records())
    seconds = time.perf_counter() - t0
    s = feed.summary
    if rows != s.rows:
        raise SystemExit(f"the consumer saw {rows} rows, the feed counted {s.rows}")
    return {"seconds": seconds, "samples": s.samples, "tokens": s.tokens, "rows": s.rows, "errors": s.errors}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="scripts/demo_run.toml", help="an extract config file")
    p.add_argument("--mode", default=None, choices=["generate", "prefill"], help="override the config's mode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ahead", type=int, default=64)
    p.add_argument("--out", default="bench_out/bench_stream.json")
    a = p.parse_args(argv)
    cfg = ExtractConfig.from_file(a.config)
    if a.mode:
        cfg = dataclasses.replace(cfg, mode=a.mode)
    runs = []
    with tempfile.TemporaryDirectory(prefix="hsx-bench-stream-") as tmp:
        for r in range(a.repeats):
            order = ("extract", "stream") if r % 2 == 0 else ("stream", "extract")
            done = {}
            for side in order:
                done[side] = time_extract(cfg, Path(tmp) / f"out{r}") if side == "extract" else time_stream(cfg, a.ahead)
            for key in ("samples", "tokens", "rows", "errors"):
                if done["extract"][key] != done["stream"][key]:
                    raise SystemExit(f"repeat {r}: extract gave {done['extract'][key]} {key}, the stream {done['stream'][key]}")
            ratio = done["extract"]["seconds"] / done["stream"]["seconds"]  # throughput of stream / extract
            runs.append({"repeat": r, "first": order[0], **{f"{k}_s": v["seconds"] for k, v in done.items()},
                         "tokens": done["stream"]["tokens"], "ratio": ratio})
            print(f"repeat {r} ({order[0]} first): extract {done['extract']['seconds']:.2f} s, stream "
                  f"{done['stream']['seconds']:.2f} s, {done['stream']['tokens']} tokens; stream/extract throughput {ratio:.3f}",
                  flush=True)
    result = {"config": a.config, "mode": cfg.mode, "repeats": a.repeats, "ahead": a.ahead, "runs": runs,
              "ratio_median": statistics.median(r["ratio"] for r in runs)}
    print(f"stream / extract throughput, median of {a.repeats}: {result['ratio_median']:.3f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
