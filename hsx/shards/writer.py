"""Writing shards: one Parquet file per :class:`ShardWriter`, a directory of them per :class:`ShardSink`.

``ShardWriter`` has one write entry point (a batch of records -> one row group), creates its
file lazily on the first batch, and ``finalize()`` returns counts. ``ShardSink`` sits above it:
it buffers records up to a row-group budget, hands row groups to ``lanes`` shards written in
parallel (Parquet's zstd runs outside the GIL), rotates a lane's shard at a byte or sample budget,
writes each shard under a hidden staging name, fsyncs, commits it to the manifest, and only then
renames it to its visible name: a reader that lists the directory (pandas, pyarrow, datasets)
never sees a shard the manifest does not commit.
"""

from __future__ import annotations

import errno
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hsx.errors import ShardError
from hsx.shards import format as fmt
from hsx.shards import positions
from hsx.shards.cells import Cells
from hsx.shards.manifest import (ErrorRecord, Manifest, ShardEntry, publish, save_manifest, staged_name,
                                 streamed_checksum)
from hsx.storage.store import StoreError, as_path, is_remote, spool_file

DEFAULT_LANES = min(4, os.cpu_count() or 1)  # BackgroundSink's lanes: the pipeline's parallel shard writers
ROW_GROUP_BYTES = 64 << 20  # records' bytes per row group (with several lanes, per shard)


class Columns(dict):
    """A sample's hidden columns by name: ``cols["final"]`` or, as a shard's samples spell it, ``cols("final")``."""

    def __call__(self, name: str) -> torch.Tensor:
        return self[name]


@dataclass
class Record:
    """One sample as it goes into a shard (or comes out of ``hsx.stream``)."""

    sample_id: str
    source_index: int
    input_ids: torch.Tensor  # [N] integer
    prompt_len: int
    loss_mask: torch.Tensor  # [N] 0/1
    finish_reason: str
    hidden: Mapping[str, torch.Tensor]  # name -> [rows, W] in the stored dtype
    accept_lens: torch.Tensor | None = None  # [verify_steps] int
    verify_steps: int | None = None  # used when accept_lens is None: an engine that reports only the count
    # Set when ``hidden`` is still being copied from the device: an event whose ``synchronize()``
    # returns once the copies are done (see :class:`hsx.align.AlignedSample`).
    ready: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.hidden = Columns(self.hidden)

    def wait(self) -> None:
        """Block until ``hidden`` holds its values; every reader of the tensors calls this first."""
        if self.ready is not None:
            self.ready.synchronize()

    @property
    def num_rows(self) -> int:
        return next(iter(self.hidden.values())).shape[0] if self.hidden else 0

    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.hidden.values()) + 5 * self.input_ids.numel()


@dataclass
class ShardStats:
    samples: int
    rows: int
    tokens: int
    bytes: int


def _leaf(field: pa.Field) -> str:
    """The Parquet column path that per-column writer options are keyed by.

    A list column's values live in the leaf ``<name>.list.element``; pyarrow silently ignores
    options keyed by the bare name of a nested column.
    """
    return f"{field.name}.list.element" if pa.types.is_list(field.type) else field.name


def _int_lists(parts: Sequence[torch.Tensor], arrow_type: pa.DataType, np_dtype) -> pa.Array:
    lengths = np.fromiter((p.numel() for p in parts), dtype=np.int32, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([p.reshape(-1).numpy().astype(np_dtype, copy=False) for p in parts]) if parts else np.zeros(0, np_dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=arrow_type))


def _optional_int_lists(parts: Sequence[torch.Tensor | None]) -> pa.Array:
    present = [p if p is not None else torch.zeros(0, dtype=torch.int16) for p in parts]
    arr = _int_lists(present, pa.int16(), np.int16)
    if all(p is not None for p in parts):
        return arr
    mask = pa.array([p is None for p in parts])
    return pa.ListArray.from_arrays(arr.offsets, arr.values, mask=mask)


class ShardWriter:
    """Writes batches of :class:`Record` to one Parquet file. Use as a context manager or call ``finalize``.

    A record whose rows take more than ``piece_bytes`` in its widest column is written in pieces
    (format 6, see :mod:`hsx.shards.format`), each a row group of its own, encoded one at a time.
    """

    def __init__(self, path: str | Path, metadata: Mapping, piece_bytes: int = fmt.PIECE_BYTES):
        self.path = Path(path)
        self.metadata = dict(metadata)
        self.schema = fmt.schema_for(self.metadata)
        self.layers = [(g["name"], g["width"]) for g in self.metadata["layers"]]
        self.cells = {g["name"]: Cells.of(self.metadata, g) for g in self.metadata["layers"]}
        widest = max((c.stored_row_bytes for c in self.cells.values()), default=1)
        self.piece_rows = max(1, piece_bytes // widest)  # rows a piece holds
        self.compression = fmt.CODECS[fmt.codec_of(self.metadata)][0]
        self.keep, self.mode = fmt.keep_of(self.metadata), self.metadata["mode"]
        self._writer: pq.ParquetWriter | None = None
        self._stats = ShardStats(0, 0, 0, 0)

    def _open(self) -> pq.ParquetWriter:
        hidden = [name for name, _ in self.layers]
        base = [f.name for f in self.schema if f.name not in hidden]
        codec = {_leaf(self.schema.field(name)): "zstd" for name in base}
        level = {_leaf(self.schema.field(name)): 1 for name in base}
        encoding = {}
        if "positions" in base:
            encoding[_leaf(self.schema.field("positions"))] = "DELTA_BINARY_PACKED"  # ascending: ~1 bit a row
        for name in hidden:
            codec[_leaf(self.schema.field(name))] = self.compression
            if self.compression == "zstd":
                level[_leaf(self.schema.field(name))] = fmt.ZSTD_LEVEL
            # The value lengths (all equal) are delta-packed ahead of the data, which stays one
            # contiguous run of bytes: no 4-byte length before every value as PLAIN would write.
            encoding[_leaf(self.schema.field(name))] = "DELTA_LENGTH_BYTE_ARRAY"
        return pq.ParquetWriter(
            self.path,
            self.schema,
            compression=codec,
            compression_level=level,
            use_dictionary=["finish_reason"],
            column_encoding=encoding,
            write_statistics=["source_index", "prompt_len", "verify_steps"],
            write_page_checksum=True,
            # 8 MiB pages: zstd sees more of the planes at once (SmolLM2 eagle3: 1.78x smaller, 1.65x with 1 MiB)
            data_page_size=8 << 20,
        )

    def write(self, records: Sequence[Record]) -> None:
        """Write ``records`` as one row group (a long record: a row group per piece, in order)."""
        if not records:
            return
        for r in records:
            r.wait()
        for r in records:
            if set(r.hidden) != {n for n, _ in self.layers}:
                raise ShardError(f"sample {r.sample_id!r}: columns {sorted(r.hidden)}, shard expects {[n for n, _ in self.layers]}")
            if r.num_rows > self.piece_rows and fmt.FIRST_ROW.name not in self.schema.names:
                raise ShardError(f"sample {r.sample_id!r}: {r.num_rows} rows need pieces of {self.piece_rows}, which "
                                 f"format {self.metadata.get('format_version')} shards cannot hold")
        if self._writer is None:
            self._writer = self._open()
        whole: list[tuple[Record, int, int | None]] = []
        for r in records:
            n = r.num_rows
            if n <= self.piece_rows:
                whole.append((r, 0, None))
                continue
            self._write_group(whole)
            whole = []
            pos = self._positions(r)
            for a in range(0, n, self.piece_rows):
                self._write_group([(r, a, min(n, a + self.piece_rows))], pos)
        self._write_group(whole)
        self._stats.samples += len(records)
        self._stats.rows += sum(r.num_rows for r in records)
        self._stats.tokens += sum(int(r.input_ids.numel()) for r in records)

    def _write_group(self, parts: list[tuple[Record, int, int | None]], pos: torch.Tensor | None = None) -> None:
        """One row group: a Parquet row for each (record, first row, end row or None for all of its rows);
        ``pos``: the positions of a single record's rows, when known."""
        if not parts:
            return
        records = [r for r, _, _ in parts]
        arrays = [
            pa.array([r.sample_id for r in records], pa.string()),
            pa.array([r.source_index for r in records], pa.int64()),
            _int_lists([r.input_ids for r in records], pa.int32(), np.int32),
            pa.array([r.prompt_len for r in records], pa.int32()),
            _int_lists([r.loss_mask for r in records], pa.uint8(), np.uint8),
            pa.array([r.finish_reason for r in records], pa.string()),
            pa.array([r.verify_steps if r.accept_lens is None else r.accept_lens.numel() for r in records], pa.int32()),
            _optional_int_lists([r.accept_lens for r in records]),
        ]
        if "positions" in self.schema.names:
            every = [pos if pos is not None else self._positions(r) for r in records]  # each record's positions
            arrays.append(_int_lists([p[a:b] for p, (_, a, b) in zip(every, parts)], pa.int32(), np.int32))
        if fmt.FIRST_ROW.name in self.schema.names:
            arrays.append(pa.array([a for _, a, _ in parts], pa.int64()))
        for name, _ in self.layers:
            arrays.append(self.cells[name].encode([r.hidden[name] if b is None else r.hidden[name][a:b] for r, a, b in parts]))
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema), row_group_size=len(parts))

    def _positions(self, r: Record) -> torch.Tensor:
        """The positions the ``keep`` rule gives the sample (rows that disagree are ``hsx verify``'s to report)."""
        pos = positions.sample_positions(self.keep, self.mode, int(r.input_ids.numel()), r.prompt_len,
                                         r.loss_mask.numpy())
        return torch.from_numpy(pos)

    def finalize(self) -> ShardStats:
        """Close the file (writing an empty shard if nothing was written) and return its counts."""
        if self._writer is None:
            self._writer = self._open()
        self._writer.close()
        self._stats.bytes = self.path.stat().st_size
        return self._stats

    def abort(self) -> None:
        """Close the file if open and remove it: a partial shard never stays behind."""
        if self._writer is not None:
            try:
                self._writer.close()
            except (OSError, pa.ArrowException):  # the disk that failed the write may fail the footer too
                pass
            self._writer = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif self._writer is not None:
            self._writer.close()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


class _WriteFailed(Exception):
    """A lane's write failed; :meth:`ShardSink._surfacing` turns it into the ShardError callers see."""

    def __init__(self, shard: str, error: OSError, written: int):
        super().__init__(shard, error, written)
        self.shard, self.error, self.written = shard, error, written


SHARD_NAME = re.compile(r"shard-(\d{5})\.parquet")


@dataclass(eq=False)  # lanes are told apart by identity (two empty lanes are not the same lane)
class _Lane:
    """One shard being written: its writer, what it holds, and the row group in flight on its thread."""

    writer: ShardWriter | None = None
    name: str = ""
    ids: list[str] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    bytes: int = 0
    pending: Future | None = None
    sealed: tuple[ShardStats, str] | None = None  # its counts and checksum once closed and stored (fsynced or uploaded)


class ShardSink:
    """A directory of shards with a manifest; the pipeline's only way to write.

    ``add`` buffers a record; a row group is written when the buffer reaches ``row_group_bytes`` or
    would fill a shard (``max_shard_bytes``, ``max_shard_samples``). With one lane the row groups
    fill a shard, which is committed (fsync, manifest, rename to its visible name) when full. With
    ``lanes`` > 1 each row group is a shard of its own, given to the next lane in turn and written,
    closed and fsynced (in an object store: uploaded) on that lane's thread (one in flight per lane),
    so that the encoding, zstd and storing of ``lanes`` shards run at once; a lane's shard is
    committed when its turn comes round again. Either way the
    shards, in the order of their names, hold the records in the order of the ``add`` calls, and
    the same calls give the same files. ``commit`` commits every lane. Errors recorded with
    ``add_error`` are committed with the next shard.

    ``names`` gives the k-th shard's file name (default ``shard-00000.parquet``, numbered on from
    the manifest's shards). With ``persist=False`` shards are still written and fsynced under their
    staging names, and ``manifest`` collects their entries, but no manifest file is written and
    nothing is renamed: a caller that owns the real manifest commits and publishes them (the Ray
    driver, for its workers).

    A write that fails (a full disk) raises :class:`ShardError` naming the directory, the shard
    and the bytes written; the partial file is removed, and every shard committed before stays.
    """

    def __init__(
        self,
        directory: str | Path,
        manifest: Manifest,
        *,
        max_shard_bytes: int = 512 << 20,
        max_shard_samples: int = 100_000,
        row_group_bytes: int = ROW_GROUP_BYTES,
        piece_bytes: int = fmt.PIECE_BYTES,
        lanes: int = 1,
        names: Callable[[int], str] | None = None,
        persist: bool = True,
    ):
        self.dir = as_path(directory)  # a local directory or a prefix in an object store (hsx.storage.store)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = manifest
        self.max_shard_bytes = max_shard_bytes
        self.max_shard_samples = max_shard_samples
        self.row_group_bytes = row_group_bytes
        self.piece_bytes = piece_bytes
        if lanes < 1:
            raise ShardError(f"lanes must be >= 1, got {lanes}")
        self.lanes = [_Lane() for _ in range(lanes)]
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"hsx-shard-lane{k}") for k in range(lanes)] if lanes > 1 else []
        self._turn = 0
        self._buffer: list[Record] = []
        self._buffer_bytes = 0
        self._pending_errors: list[ErrorRecord] = []
        self.names = names or shard_name
        self.persist = persist
        self.bytes_written = 0  # bytes of the shards committed by this sink
        numbered = (SHARD_NAME.fullmatch(s.file) for s in manifest.shards)
        self._next = 0 if names else 1 + max((int(m.group(1)) for m in numbered if m), default=-1)
        if persist:  # shards a crash left committed but not yet renamed
            publish(self.dir, manifest.shards)
        self._published = len(manifest.shards)  # manifest entries before this are under their visible names

    def add(self, record: Record) -> None:
        with self._surfacing():
            self._add(record)

    def _add(self, record: Record) -> None:
        self._buffer.append(record)
        self._buffer_bytes += record.nbytes()
        lane = self.lanes[self._turn]  # the lane the buffer goes to (several lanes: a fresh shard)
        held_bytes, held_samples = (0, 0) if self._threads else (lane.bytes, len(lane.ids))
        full = (held_bytes + self._buffer_bytes >= self.max_shard_bytes
                or held_samples + len(self._buffer) >= self.max_shard_samples)
        if self._buffer_bytes >= self.row_group_bytes or full:
            self._flush_row_group()

    def add_error(self, sample_id: str, source_index: int, reason: str) -> None:
        self._pending_errors.append(ErrorRecord(sample_id, int(source_index), reason))

    def _flush_row_group(self) -> None:
        if not self._buffer:
            return
        k = self._turn  # the lane with the oldest shard
        if self._threads and self.lanes[k].writer is not None:
            self._commit_lane(self.lanes[k])  # its row group was written while the other lanes took theirs
            self._save()
        self._turn = (k + 1) % len(self.lanes)
        lane = self.lanes[k]
        if lane.writer is None:
            lane.name = self.names(self._next)
            self._next += 1
            # in an object store the shard is encoded into a local spool file, uploaded when committed
            lane.writer = ShardWriter(spool_file(self.dir / staged_name(lane.name)), self.manifest.metadata,
                                      self.piece_bytes)
        records, nbytes = self._buffer, self._buffer_bytes
        self._buffer, self._buffer_bytes = [], 0
        lane.ids += [r.sample_id for r in records]
        lane.sources += [int(r.source_index) for r in records]
        lane.bytes += nbytes
        if self._threads:  # the row group is the lane's whole shard: closed and stored on its thread too
            lane.pending = self._threads[k].submit(self._write, lane, records, True)
            return
        self._write(lane, records)
        if lane.bytes >= self.max_shard_bytes or len(lane.ids) >= self.max_shard_samples:
            self._commit_lane(lane)
            self._save()

    def _write(self, lane: _Lane, records: list[Record], seal: bool = False) -> None:
        try:
            lane.writer.write(records)
            if seal:
                self._seal(lane)
        except OSError as e:
            self._fail(lane, e)

    def _seal(self, lane: _Lane) -> None:
        """Close the lane's shard and store its bytes where they stay: fsynced on a local disk; in an object
        store uploaded under its staging name and the spool file removed (the upload is what lasts, so the
        spool file is not fsynced). Committing it is then a manifest entry (:meth:`_commit_lane`)."""
        stats = lane.writer.finalize()
        tmp = lane.writer.path
        checksum = streamed_checksum(tmp)
        if is_remote(self.dir):
            (self.dir / staged_name(lane.name)).upload(tmp)
            tmp.unlink()
        else:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        lane.sealed = stats, checksum

    def in_flight(self) -> bool:
        """Whether a lane is still writing a row group."""
        return any(lane.pending is not None for lane in self.lanes)

    def drain(self) -> None:
        """Wait for every lane's row group in flight; a failed write raises here, after the shards
        older than the failed one, all written, are committed."""
        with self._surfacing():
            waited = []
            try:
                for lane in self._oldest_first():
                    self._wait(lane)
                    waited.append(lane)
            except _WriteFailed:
                older = [lane for lane in waited if lane.writer is not None]
                if older:  # whole shards; the error records may name later rows: a resume records them again
                    self._pending_errors = []
                    self._commit_lanes(older)
                raise

    def _oldest_first(self) -> list[_Lane]:
        n = len(self.lanes)
        return [self.lanes[(self._turn + j) % n] for j in range(n)]

    def _wait(self, lane: _Lane) -> None:
        if lane.pending is not None:
            pending, lane.pending = lane.pending, None
            pending.result()

    def _fail(self, lane: _Lane, error: OSError) -> None:
        """Remove the lane's partial shard and raise what failed, where, after how many bytes."""
        path = lane.writer.path
        written = path.stat().st_size if path.exists() else 0
        lane.writer.abort()
        raise _WriteFailed(lane.name, error, written) from error

    @contextmanager
    def _surfacing(self):
        """A failed write becomes a ShardError saying what the output keeps (counted when raised)."""
        try:
            yield
        except _WriteFailed as failed:
            error = failed.error
            if isinstance(error, StoreError):
                raise ShardError(
                    f"{error}, while uploading shard {failed.shard}; {len(self.manifest.shards)} shard(s) committed "
                    f"before it ({self.bytes_written:,} bytes by this run) stay committed. Run the same command again "
                    "once the store answers to resume."
                ) from error
            what = "the disk is full" if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "a write failed"
            raise ShardError(
                f"{self.dir}: {what} ({error.strerror or error}) while writing shard {failed.shard} ({failed.written:,} "
                f"bytes of it written, removed); {len(self.manifest.shards)} shard(s) committed before it "
                f"({self.bytes_written:,} bytes by this run) stay committed. Free space and run the same command "
                "again to resume."
            ) from error

    def _commit_lane(self, lane: _Lane) -> None:
        """Seal the lane's shard (if its thread has not) and add its entry to the manifest (published after the save)."""
        self._wait(lane)  # with several lanes, its thread has sealed the shard
        if lane.writer is None:
            return
        if lane.sealed is None:
            try:
                self._seal(lane)
            except OSError as e:
                self._fail(lane, e)
        stats, checksum = lane.sealed
        self.manifest.shards.append(
            ShardEntry(lane.name, stats.samples, stats.rows, stats.tokens, stats.bytes, checksum,
                       list(lane.ids), list(lane.sources))
        )
        self.bytes_written += stats.bytes
        self.lanes[self.lanes.index(lane)] = _Lane()

    def _save(self) -> None:
        self.manifest.errors.extend(self._pending_errors)
        self._pending_errors = []
        if self.persist:
            try:
                save_manifest(self.dir, self.manifest)
            except OSError as e:
                again = "once the store answers" if isinstance(e, StoreError) else "after freeing space"
                named = ", ".join(s.file for s in self.manifest.shards[self._published:]) or "none"
                raise ShardError(f"{self.dir}: could not save the manifest ({e.strerror or e}) committing shard(s) "
                                 f"{named}; the shards committed by the last save stay committed. Run the same "
                                 f"command again {again}.") from e
            publish(self.dir, self.manifest.shards[self._published:])  # the ones this save committed
            self._published = len(self.manifest.shards)

    def commit(self) -> None:
        """Make everything added so far durable: close every lane's shard, record them in the manifest."""
        with self._surfacing():
            self._flush_row_group()
            self._commit_lanes(self._oldest_first())

    def _commit_lanes(self, lanes: list[_Lane]) -> None:
        """Commit these lanes' shards in turn and save the manifest; when one fails, the ones before it
        are saved and stay."""
        try:
            for lane in lanes:
                self._commit_lane(lane)
        except _WriteFailed:
            self.manifest.complete = False  # close() sets it before its commit
            self._pending_errors = []  # they may name rows after the failed shard's: a resume records them again
            self._save()
            raise
        self._save()

    def close(self, complete: bool = True) -> Manifest:
        """Commit what is left and mark the output complete."""
        self.manifest.complete = complete
        try:
            self.commit()
        finally:
            self._shutdown()
        return self.manifest

    def _shutdown(self) -> None:
        for t in self._threads:
            t.shutdown(wait=True)

    def abort(self) -> None:
        """Drop what is not committed: buffered records and the lanes' partial shards."""
        for lane in self.lanes:
            try:
                self._wait(lane)
            except Exception:  # the lane failed; its file is removed below either way
                pass
            if lane.writer is not None:
                lane.writer.abort()
        self._buffer, self._buffer_bytes = [], 0
        self._shutdown()

    def __enter__(self) -> "ShardSink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
