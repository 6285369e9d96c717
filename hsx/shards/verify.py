"""``hsx verify`` and ``hsx inspect``: integrity checks and a summary of an output directory."""

from __future__ import annotations

from collections import Counter

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from hsx.errors import ShardError
from hsx.shards import format as fmt
from hsx.shards import positions
from hsx.storage.lease import LEASE
from hsx.storage.lock import LOCK
from hsx.shards.manifest import (CONFIG, LEGACY_CONFIG, LEGACY_MANIFEST, MANIFEST, Manifest, ShardEntry, foreign_names,
                                 load_manifest, shard_path)
from hsx.shards.packed import repeats
from hsx.shards.shard import Shard, load_shard
from hsx.storage.store import as_path, open_ranged


@dataclass
class ShardReport:
    file: str
    samples: int = 0
    rows: int = 0
    faults: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    path: str
    shards: list[ShardReport] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # not tied to one shard
    ignored: list[str] = field(default_factory=list)  # files the manifest does not name
    foreign: list[str] = field(default_factory=list)  # visible files and folders hsx did not write
    errors: int = 0  # samples recorded as errors (bad input), not faults
    complete: bool | None = None  # the manifest's: False while a run is in progress or after it stopped; None for one file
    samples: int = 0  # samples the manifest commits

    @property
    def ok(self) -> bool:
        return not self.faults and all(not s.faults for s in self.shards)


def _lengths(chunked: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(chunked).to_numpy(zero_copy_only=False).astype(np.int64)


def check_table(table: pa.Table, meta: dict, rows: dict[str, np.ndarray]) -> list[str]:
    """Row-level checks of a shard's small columns (a row per sample): the rows each hidden column holds
    (``rows``: column -> [samples]) against what the tokens and the keep rule give, per-token columns,
    positions, accept lengths."""
    faults = []
    ids = table.column("sample_id").to_pylist()
    n_tok = _lengths(table.column("input_ids"))
    mask_len = _lengths(table.column("loss_mask"))
    keep = fmt.keep_of(meta)
    if np.array_equal(mask_len, n_tok):
        want = stored_rows(table, meta)
        rule = f"{meta['mode']} mode covers positions {fmt.COVERS[meta['mode']]}" + ("" if keep == "all" else f", keep={keep!r} stores")
    else:  # the keep rule needs a loss mask per token; the mask fault is reported below
        want, rule = fmt.expected_rows(n_tok, meta["mode"]), f"{meta['mode']} mode covers positions {fmt.COVERS[meta['mode']]}"
    for g in meta["layers"]:
        got = rows[g["name"]]
        bad = np.flatnonzero(got != want)
        for j in bad[:5]:
            faults.append(f"sample {ids[j]!r}: {got[j]} rows of {g['name']!r} for {n_tok[j]} tokens; {rule} ({want[j]} rows)")
        if len(bad) > 5:
            faults.append(f"... and {len(bad) - 5} more samples with wrong row counts in {g['name']!r}")
    for j in np.flatnonzero(mask_len != n_tok)[:5]:
        faults.append(f"sample {ids[j]!r}: loss_mask has {mask_len[j]} entries for {n_tok[j]} tokens")
    prompt = table.column("prompt_len").to_numpy()
    for j in np.flatnonzero((prompt < 0) | (prompt > n_tok))[:5]:
        faults.append(f"sample {ids[j]!r}: prompt_len {prompt[j]} outside 0..{n_tok[j]}")
    if "positions" in table.column_names and np.array_equal(mask_len, n_tok):
        faults += _check_positions(table, meta, ids, n_tok)
    faults += _check_accept(table, ids, n_tok - prompt)
    return faults


def scan_hidden(shard: Shard) -> tuple[dict[str, np.ndarray], list[str]]:
    """Every hidden column of a shard read one row group at a time (a long sample's pieces one by one, so
    that memory is a row group's, not the shard's): the rows each sample holds, per column, and the
    NaN/Inf faults, naming the first such row's sample and position."""
    ids = shard.meta.column("sample_id")
    spans = shard.sample_spans
    owner = np.repeat(np.arange(len(spans) - 1), np.diff(spans))  # Parquet row -> its sample
    rows, faults = {}, []
    for name in shard.widths:
        per_row = np.zeros(int(spans[-1]), np.int64)  # rows each Parquet row holds
        bad, first_bad = 0, None
        for first, got, block in shard.groups(name):
            per_row[first:first + len(got)] = got
            finite = torch.isfinite(block).all(dim=1).numpy()
            if first_bad is None and not finite.all():
                at = int(np.flatnonzero(~finite)[0])
                p = first + int(np.searchsorted(np.cumsum(got), at, side="right"))  # that row's Parquet row
                first_bad = p, at - int(got[:p - first].sum())
            bad += int((~finite).sum())
            block = None
        rows[name] = np.bincount(owner, weights=per_row, minlength=len(spans) - 1).astype(np.int64)
        listed = shard.listed_rows
        if listed is not None:  # a long sample's pieces each hold the rows their positions list
            pieces = np.diff(spans)[owner] > 1
            off = np.flatnonzero(pieces & (per_row != listed))
            if len(off):
                p = int(off[0])
                faults.append(f"sample {ids[int(owner[p])].as_py()!r}: a piece holds {int(per_row[p])} rows of "
                              f"{name!r}, its positions column lists {int(listed[p])}")
        if first_bad is not None:
            p, at = first_bad
            j = int(owner[p])
            at += int(per_row[spans[j]:p].sum())  # rows of the sample's earlier pieces
            faults.append(f"column {name!r}: {bad} rows with NaN/Inf (first in sample {ids[j].as_py()!r}, position {at})")
    return rows, faults


def stored_rows(table: pa.Table, meta: dict) -> np.ndarray:
    """[samples] rows each sample must have: the covered positions the shard's ``keep`` rule selects."""
    n_tok = _lengths(table.column("input_ids"))
    if fmt.keep_of(meta) == "all":
        return fmt.expected_rows(n_tok, meta["mode"])
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False)
    offsets = np.concatenate([[0], np.cumsum(n_tok)])
    return positions.stored_rows(fmt.keep_of(meta), meta["mode"], n_tok,
                                 table.column("prompt_len").to_numpy().astype(np.int64), mask, offsets)


def _check_accept(table: pa.Table, ids: list[str], completion: np.ndarray) -> list[str]:
    faults = []
    steps = table.column("verify_steps").to_pylist()
    accept = table.column("accept_lens").to_pylist()  # small ints, one per verify step
    for j, (n, a) in enumerate(zip(steps, accept)):
        if a is not None and n != len(a):  # a count without accept lengths is allowed (--engine sglang)
            faults.append(f"sample {ids[j]!r}: verify_steps {n} but {None if a is None else len(a)} accept lengths")
        elif a:
            # The first completion token comes from the prefill; steps cover the rest, and only
            # the last step may overshoot.
            decoded = int(completion[j]) - 1
            if sum(a) < decoded or sum(a) - a[-1] >= max(decoded, 1):
                faults.append(f"sample {ids[j]!r}: accept lengths sum to {sum(a)} for {decoded} decoded tokens")
    return faults


def _check_positions(table: pa.Table, meta: dict, ids: list[str], n_tok: np.ndarray) -> list[str]:
    """The ``positions`` column (format 4) lists exactly the positions the ``keep`` rule gives."""
    offsets = np.concatenate([[0], np.cumsum(n_tok)])
    mask = pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False)
    owner, want = positions.kept(fmt.keep_of(meta), meta["mode"], n_tok, table.column("prompt_len").to_numpy().astype(np.int64),
                                 mask, offsets)
    got = pc.list_flatten(table.column("positions")).to_numpy(zero_copy_only=False)
    got_owner = np.repeat(np.arange(len(n_tok)), _lengths(table.column("positions")))
    if len(got) == len(want) and np.array_equal(got, want) and np.array_equal(got_owner, owner):
        return []
    bad = next((j for j in range(len(n_tok)) if not np.array_equal(got[got_owner == j], want[owner == j])), 0)
    return [f"sample {ids[bad]!r}: positions column {got[got_owner == bad][:8].tolist()}... differs from what "
            f"keep={fmt.keep_of(meta)!r} gives {want[owner == bad][:8].tolist()}..."]


def verify(path: str | Path) -> VerifyReport:
    """Check a directory (manifest vs files, checksums, schema, alignment row counts, NaN/Inf) or one file."""
    path = as_path(path)  # a local path, or s3://bucket/prefix
    report = VerifyReport(str(path))
    if path.is_file():
        report.shards.append(_verify_one(path, None, None))
        return report
    try:
        m = load_manifest(path)
    except ShardError as e:
        report.faults.append(str(e))
        return report
    report.errors, report.complete, report.samples = len(m.errors), m.complete, m.num_samples
    report.ignored = _unnamed_files(path, m)
    report.foreign = foreign_names(path)
    repeated = repeats([entry.sample_ids for entry in m.shards])  # one sort of every id, not a set of them
    for k, entry in enumerate(m.shards):
        r = _verify_one(shard_path(path, entry.file), entry, m)
        if k in repeated:
            r.faults.append(f"sample ids also in an earlier shard: {repeated[k][:5]}")
        report.shards.append(r)
    return report


def _unnamed_files(path: Path, m: Manifest) -> list[str]:
    """Files the manifest does not name, in the output's folder and the folders its shards fan out to."""
    named = {s.file for s in m.shards} | {MANIFEST, CONFIG, LEGACY_MANIFEST, LEGACY_CONFIG, LOCK, LEASE}
    folders = sorted({s.file.rpartition("/")[0] for s in m.shards} - {""})
    files = [p.name for p in path.iterdir() if p.is_file()]
    files += [f"{f}/{p.name}" for f in folders for p in (path / f).iterdir() if p.is_file()]
    return sorted(name for name in files if name not in named)


def _verify_one(path: Path, entry: ShardEntry | None, m: Manifest | None) -> ShardReport:
    r = ShardReport(path.name)
    try:
        shard = load_shard(path, entry, cache_blocks=1, check_hidden=False)  # scan_hidden reads every row group
        rows, finite = scan_hidden(shard)
    except ShardError as e:
        r.faults.append(str(e))
        return r
    r.samples = shard.meta.num_rows
    if m is not None and shard.metadata != m.metadata:
        r.faults.append("shard metadata differs from the manifest's")
    r.faults += check_table(shard.meta, shard.metadata, rows) + finite
    if shard.metadata["layers"]:
        r.rows = int(rows[shard.metadata["layers"][0]["name"]].sum())
    if entry is not None and r.rows != entry.rows:
        r.faults.append(f"{r.rows} rows, manifest says {entry.rows}")
    return r


def _pieces_column(meta: dict) -> list[str]:
    return [fmt.FIRST_ROW.name] if meta.get("format_version", fmt.FORMAT_VERSION) >= 6 else []


def _first_pieces(table: pa.Table) -> pa.Table:
    """One row per sample: a long sample's first piece (the others repeat its token columns)."""
    starts = fmt.sample_starts(table)
    return table if starts is None else table.take(pa.array(starts))


def _read_schema(path: Path) -> pa.Schema:
    try:
        with open_ranged(path, 1 << 20) as f:
            return pq.read_schema(f)
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: not a readable Parquet file ({e})") from None


def _read_columns(path: Path, cols: list[str]) -> pa.Table:
    try:
        with open_ranged(path, 1 << 20) as f:  # in a store: the footer and these columns' chunks only
            return pq.read_table(f, columns=cols)
    except FileNotFoundError:
        raise ShardError(f"{path}: shard listed in the manifest is missing") from None
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: unreadable Parquet ({e})") from None


def inspect(path: str | Path) -> dict:
    """Summary of an output directory or file (local or ``s3://``), reading only the small metadata columns."""
    path = as_path(path)
    if path.is_dir():
        m = load_manifest(path)
        files = [shard_path(path, s.file) for s in m.shards]
        meta, errors, complete = m.metadata, m.errors, m.complete
    elif path.exists():
        files = [path]
        meta, errors, complete = fmt.read_metadata(_read_schema(path), str(path)), [], None
    else:
        raise ShardError(f"{path}: no such file or directory")
    cols = ["input_ids", "prompt_len", "loss_mask", "accept_lens", "finish_reason"]
    # one shard's small columns at a time, into running totals: the memory of one shard, whatever the output holds
    samples = tokens = prompt_tokens = covered = rows = 0
    reasons, accept = Counter(), Counter()
    for f in files:
        t = _first_pieces(_read_columns(f, cols + _pieces_column(meta))).select(cols)
        if not t.num_rows:
            continue
        n_tok = _lengths(t.column("input_ids"))
        samples += t.num_rows
        tokens += int(n_tok.sum())
        prompt_tokens += int(t.column("prompt_len").to_numpy().sum())
        covered += int(fmt.expected_rows(n_tok, meta["mode"]).sum())
        rows += int(stored_rows(t, meta).sum())
        for counted in pc.value_counts(t.column("finish_reason").combine_chunks()).to_pylist():
            reasons[counted["values"]] += counted["counts"]
        steps = pc.list_flatten(t.column("accept_lens")).to_numpy(zero_copy_only=False)
        accept.update(dict(zip(*(a.tolist() for a in np.unique(steps, return_counts=True)))))
    row_bytes = sum(fmt.row_bytes(g["width"], meta["dtype"]) for g in meta["layers"])
    size = sum(f.stat().st_size for f in files)
    summary = {
        "path": str(path),
        "complete": complete,
        "shards": len(files),
        "samples": samples,
        "errors": len(errors),
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tokens - prompt_tokens,
        "rows_per_column": rows,
        "keep": fmt.keep_of(meta),
        "rows_covered": covered,  # rows with --keep all
        "bytes_saved": (covered - rows) * row_bytes,  # hidden-state bytes --keep did not store
        "error_records": [dataclasses.asdict(e) for e in errors],
        "bytes": size,
        "bytes_per_token": size / max(1, tokens),
        "dtype": meta["dtype"],
        "mode": meta["mode"],
        "layers": meta["layers"],
        "model": meta.get("model", {}),
        "engine": meta.get("engine", {}),
        "speculative": meta.get("speculative"),
        "finish_reasons": {str(k): int(v) for k, v in sorted(reasons.items())},
    }
    if accept:
        steps = sum(accept.values())
        summary["accept"] = {
            "verify_steps": steps,
            "mean_accept_len": sum(v * c for v, c in accept.items()) / steps,
            "histogram": {int(v): int(c) for v, c in sorted(accept.items())},
        }
    return summary
