"""Peak resident memory of writing, reading and exporting one long sample, against the sample's state bytes.

One sample of --tokens tokens in generate mode with two bfloat16 columns of --widths (default 576
and 1728: SmolLM2-135M's ``final`` and ``eagle3`` columns; the second holds boundaries 1, 2 and 4 of
a 4-block model) is written through ShardSink, then read and exported; each step runs in a fresh
process whose resident-set peak is reset (/proc/self/clear_refs) just before the step, and the table
gives the peak above the resident set at that point, over the sample's state bytes (rows x row
bytes, all columns):

  write        ShardSink.add + close of the record (the record itself exists before: not counted)
  read         hsx.open(out)[0].hidden(c) for every column, the tensors kept (they are counted)
  part         hsx.open(out)[0].hidden(c, rows=slice(a, a + 1024)) at four places of every column, kept
  decode       hsx.decode of each column's cells as pyarrow gives them (pieces chained; the cells are read
               before the step), the arrays kept
  loader       one pass of hsx.tokens_loader(out, batch_size=1024, shuffle_buffer=0), batches dropped
  specforge    hsx.export.specforge.export_specforge(out, ...): one .ckpt of both columns
  speculators  hsx.export.export_speculators(out, target_layer_ids=[1, 2]): hidden_states [T, 3, H]
  saelens      hsx.export.export_saelens(out, column="b4", context_size=1024): float32 contexts
  verify       hsx.shards.verify.verify(out): checksums, every row group's cells, row counts, NaN/Inf

Before its peak is reset each step runs once on a 64-token sample of the same layout (--cold: not),
so that what a library sets up on first use (code pages, thread pools, lazy imports) is not counted
as the step's: a cold process adds about 50-100 MB to each.

--before DIR runs the same steps with the hsx package found in DIR (e.g. `git worktree add DIR OLD`)
in the same table. --pool sets Arrow's memory pool (ARROW_DEFAULT_MEMORY_POOL: mimalloc, pyarrow's
default; jemalloc, which the hsx CLI uses; system).

    python scripts/long_sample_memory.py                              # 8K, 32K and 128K tokens
    python scripts/long_sample_memory.py --tokens 8192,32768 --widths 4096,12288   # Llama-3-8B's widths
    python scripts/long_sample_memory.py --steps read,part --before /tmp/hsx-before
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
STEPS = ("write", "read", "part", "decode", "loader", "specforge", "speculators", "saelens", "verify")
WARM_TOKENS = 64
VOCAB = 1000  # token ids of the sample: arange % VOCAB, so that SpecForge's vocabulary count stays small


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) << 10
    raise KeyError(key)


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _metadata(widths: list[int], codec: str) -> dict:
    from hsx.shards import build_metadata

    final, aux = widths
    layers = [{"name": "final", "sources": ["final"], "width": final, "raw_ids": None, "rule": "final norm output"},
              {"name": "eagle3", "sources": [1, 2, 4], "width": aux, "raw_ids": None, "rule": "memory test"}]
    return build_metadata(codec=codec, layers=layers, dtype="bfloat16", mode="generate",
                          model={"path": "memory-test-model", "num_layers": 4, "hidden_size": final},
                          engine={"name": "test", "version": "0"}, dataset={"path": "memory", "fingerprint": "abc"})


def _write(out: Path, meta: dict, tokens: int, record=None) -> None:
    from shard_fixtures import write_sink

    if record is None:
        record = _record(meta, tokens)
    write_sink(out, meta, [record])


def _record(meta: dict, tokens: int):
    import torch

    from shard_fixtures import make_record

    gen = torch.Generator().manual_seed(0)
    hidden = {g["name"]: torch.randn(tokens - 1, g["width"], generator=gen).to(torch.bfloat16) for g in meta["layers"]}
    record = make_record(0, tokens, meta, hidden, None)
    record.input_ids = record.input_ids % VOCAB
    return record


def _cells(out: Path, meta: dict) -> list[list]:
    """Each column's cells of the sample as pyarrow gives them, the pieces' chained in first_row order."""
    import pyarrow.parquet as pq

    (shard,) = sorted(out.glob("shard-*.parquet"))
    names = [g["name"] for g in meta["layers"]]
    table = pq.read_table(shard, columns=["first_row", *names]).sort_by("first_row")
    return [[v for cell in table.column(name).to_pylist() for v in cell] for name in names]


def _run(kind: str, out: Path, meta: dict, kept: list, cells: list | None) -> None:
    """Step ``kind`` on the shards at ``out`` (exports into folders beside it)."""
    import hsx

    dst = out.parent / f"{out.name}-{kind}"
    if kind == "read":
        ds = hsx.open(out)
        kept += [ds[0].hidden(c) for c in ds.columns]
    elif kind == "part":
        ds = hsx.open(out)
        s = ds[0]
        n = s.num_rows
        for c in ds.columns:
            for a in (0, n // 3, n // 2, max(0, n - 1024)):
                kept.append(s.hidden(c, rows=slice(a, a + 1024)))
    elif kind == "decode":
        for g, cell in zip(meta["layers"], cells):
            kept.append(hsx.decode(cell, g["width"], meta["dtype"], meta["codec"]))
    elif kind == "loader":
        seen = sum(b["position"].numel() for b in hsx.tokens_loader(out, batch_size=1024, shuffle_buffer=0))
        kept.append(seen)
    elif kind == "specforge":
        from hsx.export.specforge import export_specforge

        export_specforge(out, dst, draft_vocab_size=VOCAB // 2, target_vocab_size=VOCAB, progress=False)
    elif kind == "speculators":
        from hsx.export import export_speculators

        export_speculators(out, dst, target_layer_ids=[1, 2], progress=False)
    elif kind == "saelens":
        from hsx.export import export_saelens

        export_saelens(out, dst, column="b4", context_size=1024, progress=False)
    elif kind == "verify":
        from hsx.shards.verify import verify

        report = verify(out)
        assert report.ok, [f for s in report.shards for f in s.faults] + report.faults
        kept.append(sum(s.rows for s in report.shards))
    else:
        raise ValueError(kind)


def step(kind: str, out: str, tokens: int, widths: list[int], codec: str, warm: bool = True) -> dict:
    """One step in this process: its resident peak above the resident set before it."""
    import gc

    import torch

    torch.set_num_threads(1)
    import pyarrow.compute  # noqa: F401  (imported before the peak is reset: libraries are not the step)
    import pyarrow.parquet  # noqa: F401

    import hsx
    import hsx.shards.loader  # noqa: F401

    out = Path(out)
    meta = _metadata(widths, codec)
    rows = tokens - 1
    warm_out = out.parent / "warm"
    if kind == "write":
        if warm:
            _write(out.parent / "warm-write", meta, WARM_TOKENS)
            if not warm_out.exists():
                _write(warm_out, meta, WARM_TOKENS)
        record = _record(meta, tokens)
        gc.collect()
        base = _reset_peak()
        _write(out, meta, tokens, record)
    else:
        if warm:
            _run(kind, warm_out, meta, [], _cells(warm_out, meta) if kind == "decode" else None)
        cells = _cells(out, meta) if kind == "decode" else None
        kept: list = []
        gc.collect()
        base = _reset_peak()
        _run(kind, out, meta, kept, cells)
        if kind in ("read", "decode"):
            assert all(t.shape[0] == rows for t in kept), [tuple(t.shape) for t in kept]
        if kind in ("loader", "verify"):
            assert kept == [rows], kept
    return {"peak": _status("VmHWM") - base, "state_bytes": rows * sum(widths) * 2}


def run(kind: str, out: Path, tokens: int, widths: list[int], codec: str, tree: Path, pool: str | None,
        warm: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'tests'}"}
    code = (f"import hsx, pathlib; assert pathlib.Path(hsx.__file__).resolve().parent == "
            f"pathlib.Path({str(tree / 'hsx')!r}).resolve(), hsx.__file__; ")
    if pool:
        env["ARROW_DEFAULT_MEMORY_POOL"] = pool
    code += (f"import json, sys; sys.path[:0] = [{str(ROOT / 'scripts')!r}]; from long_sample_memory import step; "
            f"print(json.dumps(step({kind!r}, {str(out)!r}, {tokens}, {widths!r}, {codec!r}, {warm!r})))")
    # run from the output's folder: `python -c` puts the working directory first on sys.path, which from the
    # repository's root would import this checkout's hsx whatever PYTHONPATH says
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=out.parent)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="8192,32768,131072")
    p.add_argument("--widths", default="576,1728", help="the final and eagle3 widths (eagle3 three times final)")
    p.add_argument("--codec", default="planes-zstd")
    p.add_argument("--steps", default=",".join(STEPS), help=f"a comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--before", type=Path, help="a directory holding an older hsx (and its tests/) to compare with")
    p.add_argument("--pool", choices=["mimalloc", "jemalloc", "system"], help="Arrow's memory pool")
    p.add_argument("--cold", action="store_true", help="no warm-up run before each step's peak is reset")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=ROOT / "bench_out" / "long_sample_memory.json")
    a = p.parse_args()
    tokens = [2048] if a.quick else [int(t) for t in a.tokens.split(",")]
    widths = [int(w) for w in a.widths.split(",")]
    steps = [s for s in a.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown or len(widths) != 2:
        p.error(f"unknown steps {unknown}" if unknown else "--widths takes two widths: final,eagle3")
    trees = [("now", ROOT)] + ([("before", a.before.resolve())] if a.before else [])
    print(f"widths {widths} bfloat16, codec {a.codec}, Arrow pool {a.pool or 'default'}, "
          f"{'cold' if a.cold else 'after a warm-up run'}; peak above the step's start, MB and x the sample's state bytes")
    print("| tokens | state MB | tree | " + " | ".join(steps) + " |")
    print("|---:|---:|---|" + "---:|" * len(steps))
    results = []
    for n in tokens:
        for name, tree in trees:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "out"
                need = steps if "write" in steps else ["write", *steps]  # the other steps read what write wrote
                got = {kind: run(kind, out, n, widths, a.codec, tree, a.pool, not a.cold) for kind in need}
            state = next((g["state_bytes"] for g in got.values() if "state_bytes" in g), 0)
            cells = [f"{got[k]['peak'] / 1e6:,.0f} ({got[k]['peak'] / state:.2f}x)" if "peak" in got[k] else
                     got[k]["error"][:60] for k in steps]
            print(f"| {n:,} | {state / 1e6:,.0f} | {name} | " + " | ".join(cells) + " |", flush=True)
            results.append({"tokens": n, "tree": name, "widths": widths, "codec": a.codec, "pool": a.pool,
                            "warm": not a.cold, **got})
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
