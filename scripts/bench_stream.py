"""Throughput of the online feed (``hsx.stream``) against ``hsx extract`` on the same prompts.

    python scripts/bench_stream.py [--config scripts/demo_run.toml] [--repeats 6] [--mode generate|prefill] [--copies K]

In one process, alternating (the side that goes first swaps every repeat): ``extract`` of the config
into a fresh temporary output, and one pass of a fresh :class:`hsx.run.feed.Feed` over the same config
whose consumer only counts rows. Both sides include loading the dataset and the engine; warm-up
repeats come first and are not counted. Reported per repeat: wall and CPU seconds of each side and
the throughput ratio stream / extract by each (median over repeats; CPU time is less shaken by
other processes on a shared machine); the two sides must give the same samples, tokens and rows. JSON goes to ``bench_out/bench_stream.json``.
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
from hsx.run.pipeline import extract


def time_extract(cfg: ExtractConfig, out: Path) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    s = extract(dataclasses.replace(cfg, output=str(out)), progress=False)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if s.resumed:
        raise SystemExit(f"extract resumed {s.resumed} samples from {out}; each repeat needs an empty output")
    return {"seconds": seconds, "cpu_s": cpu, "samples": s.samples, "tokens": s.tokens, "rows": s.rows, "errors": s.errors}


def time_stream(cfg: ExtractConfig, ahead: int) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    feed = hsx.stream(cfg, ahead=ahead)
    rows = sum(r.num_rows for r in feed.records())
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = feed.summary
    if rows != s.rows:
        raise SystemExit(f"the consumer saw {rows} rows, the feed counted {s.rows}")
    return {"seconds": seconds, "cpu_s": cpu, "samples": s.samples, "tokens": s.tokens, "rows": s.rows, "errors": s.errors}


def copied(cfg: ExtractConfig, copies: int, path: Path) -> ExtractConfig:
    """The config over a JSONL file holding every row of its dataset ``copies`` times (ids made unique)."""
    from hsx.data.load import load_rows

    rows = load_rows(cfg.dataset, cfg.split, cfg.limit)
    with path.open("w") as f:
        for k in range(copies):
            for row in rows:
                if cfg.id_field:
                    row = {**row, cfg.id_field: f"{row[cfg.id_field]}#{k}"}
                f.write(json.dumps(row) + "\n")
    return dataclasses.replace(cfg, dataset=str(path), split="train", limit=None)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="scripts/demo_run.toml", help="an extract config file")
    p.add_argument("--mode", default=None, choices=["generate", "prefill"], help="override the config's mode")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="uncounted repeats first (imports, first-call costs)")
    p.add_argument("--ahead", type=int, default=64)
    p.add_argument("--copies", type=int, default=1, help="run every row of the dataset this many times (new ids)")
    p.add_argument("--out", default="bench_out/bench_stream.json")
    a = p.parse_args(argv)
    cfg = ExtractConfig.from_file(a.config)
    if a.mode:
        cfg = dataclasses.replace(cfg, mode=a.mode)
    runs = []
    with tempfile.TemporaryDirectory(prefix="hsx-bench-stream-") as tmp:
        if a.copies > 1:
            cfg = copied(cfg, a.copies, Path(tmp) / "rows.jsonl")
        for r in range(-a.warmup, a.repeats):
            order = ("extract", "stream") if r % 2 == 0 else ("stream", "extract")
            done = {}
            for side in order:
                done[side] = time_extract(cfg, Path(tmp) / f"out{r}") if side == "extract" else time_stream(cfg, a.ahead)
            for key in ("samples", "tokens", "rows", "errors"):
                if done["extract"][key] != done["stream"][key]:
                    raise SystemExit(f"repeat {r}: extract gave {done['extract'][key]} {key}, the stream {done['stream'][key]}")
            # throughput of the stream / of extract, by wall time and by the process's CPU time
            ratio = done["extract"]["seconds"] / done["stream"]["seconds"]
            cpu_ratio = done["extract"]["cpu_s"] / done["stream"]["cpu_s"]
            print(f"{'warm-up' if r < 0 else 'repeat'} {r} ({order[0]} first): extract {done['extract']['seconds']:.2f} s "
                  f"(cpu {done['extract']['cpu_s']:.2f}), stream {done['stream']['seconds']:.2f} s (cpu "
                  f"{done['stream']['cpu_s']:.2f}), {done['stream']['tokens']} tokens; stream/extract throughput "
                  f"{ratio:.3f} (cpu {cpu_ratio:.3f})", flush=True)
            if r >= 0:
                runs.append({"repeat": r, "first": order[0], **{f"{k}_s": v["seconds"] for k, v in done.items()},
                             **{f"{k}_cpu_s": v["cpu_s"] for k, v in done.items()}, "tokens": done["stream"]["tokens"],
                             "ratio": ratio, "cpu_ratio": cpu_ratio})
    result = {"config": a.config, "mode": cfg.mode, "copies": a.copies, "repeats": a.repeats, "ahead": a.ahead, "runs": runs,
              "ratio_median": statistics.median(r["ratio"] for r in runs),
              "cpu_ratio_median": statistics.median(r["cpu_ratio"] for r in runs)}
    print(f"stream / extract throughput, median of {a.repeats}: {result['ratio_median']:.3f} by wall time, "
          f"{result['cpu_ratio_median']:.3f} by CPU time")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
