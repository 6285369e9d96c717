"""Peak resident memory of writing and reading one long sample, against the sample's state bytes.

One sample of --tokens tokens in generate mode with two bfloat16 columns of --widths (default 576
and 1728: SmolLM2-135M's final and eagle3 columns) is written through ShardSink and read back; each
step runs in a fresh process whose resident-set peak is reset (/proc/self/clear_refs) just before the
step, and the table gives the peak above the resident set at that point, over the sample's state
bytes (rows x row bytes, all columns):

  write     ShardSink.add + close of the record (the record itself exists before: not counted)
  read      hsx.open(out)[0].hidden(c) for every column, the tensors kept (they are counted)
  loader    one pass of hsx.tokens_loader(out, batch_size=1024, shuffle_buffer=0), batches dropped

--before DIR runs the same steps with the hsx package found in DIR (e.g. `git archive OLD hsx tests |
tar -x -C DIR`) in the same table. --pool sets Arrow's memory pool (ARROW_DEFAULT_MEMORY_POOL:
mimalloc, pyarrow's default; jemalloc, which the hsx CLI uses; system).

    python scripts/long_sample_memory.py                              # 8K, 32K and 128K tokens
    python scripts/long_sample_memory.py --tokens 8192,32768 --widths 4096,12288   # Llama-3-8B's widths
    python scripts/long_sample_memory.py --quick                      # 2K tokens: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("write", "read", "loader")


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) << 10
    raise KeyError(key)


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def step(kind: str, out: str, tokens: int, widths: list[int], codec: str) -> dict:
    """One step in this process: its resident peak above the resident set before it."""
    import gc

    import torch

    torch.set_num_threads(1)
    import pyarrow.compute  # noqa: F401  (imported before the peak is reset: libraries are not the step)
    import pyarrow.parquet  # noqa: F401

    import hsx
    import hsx.shards.loader  # noqa: F401
    from shard_fixtures import make_metadata, make_record, write_sink

    meta = make_metadata(widths, "bfloat16", "generate", codec)
    rows = tokens - 1
    if kind == "write":
        gen = torch.Generator().manual_seed(0)
        hidden = {g["name"]: torch.randn(rows, g["width"], generator=gen).to(torch.bfloat16) for g in meta["layers"]}
        record = make_record(0, tokens, meta, hidden, None)
        gc.collect()
        base = _reset_peak()
        write_sink(Path(out), meta, [record])
    elif kind == "read":
        gc.collect()
        base = _reset_peak()
        ds = hsx.open(out)
        kept = [ds[0].hidden(c) for c in ds.columns]
        assert all(t.shape[0] == rows for t in kept)
    else:
        gc.collect()
        base = _reset_peak()
        seen = sum(b["position"].numel() for b in hsx.tokens_loader(out, batch_size=1024, shuffle_buffer=0))
        assert seen == rows, seen
    return {"peak": _status("VmHWM") - base, "state_bytes": rows * sum(widths) * 2}


def run(kind: str, out: Path, tokens: int, widths: list[int], codec: str, tree: Path, pool: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'tests'}"}
    if pool:
        env["ARROW_DEFAULT_MEMORY_POOL"] = pool
    code = (f"import json, sys; sys.path[:0] = [{str(ROOT / 'scripts')!r}]; from long_sample_memory import step; "
            f"print(json.dumps(step({kind!r}, {str(out)!r}, {tokens}, {widths!r}, {codec!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192,32768,131072")
    p.add_argument("--widths", default="576,1728")
    p.add_argument("--codec", default="planes-zstd")
    p.add_argument("--before", type=Path, help="a directory holding an older hsx (and its tests/) to compare with")
    p.add_argument("--pool", choices=["mimalloc", "jemalloc", "system"], help="Arrow's memory pool")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    tokens = [2048] if a.quick else [int(t) for t in a.tokens.split(",")]
    widths = [int(w) for w in a.widths.split(",")]
    trees = [("now", ROOT)] + ([("before", a.before.resolve())] if a.before else [])
    print(f"widths {widths} bfloat16, codec {a.codec}, Arrow pool {a.pool or 'default'}; peak above the step's start, "
          "MB and x the sample's state bytes")
    print(f"| tokens | state MB | tree | " + " | ".join(STEPS) + " |")
    print("|---:|---:|---|" + "---:|" * len(STEPS))
    results = []
    for n in tokens:
        for name, tree in trees:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "out"
                got = {kind: run(kind, out, n, widths, a.codec, tree, a.pool) for kind in STEPS}
            state = next((g["state_bytes"] for g in got.values() if "state_bytes" in g), 0)
            cells = [f"{g['peak'] / 1e6:,.0f} ({g['peak'] / state:.2f}x)" if "peak" in g else g["error"][:60]
                     for g in got.values()]
            print(f"| {n:,} | {state / 1e6:,.0f} | {name} | " + " | ".join(cells) + " |", flush=True)
            results.append({"tokens": n, "tree": name, "widths": widths, "codec": a.codec, "pool": a.pool, **got})
    dst = ROOT / "bench_out" / "long_sample_memory.json"
    dst.parent.mkdir(exist_ok=True)
    dst.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
