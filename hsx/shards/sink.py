"""A directory of shards with a manifest: :class:`ShardSink`, the pipeline's only way to write.

It buffers records up to a row-group budget, hands row groups to ``lanes`` shards written in
parallel (Parquet's zstd runs outside the GIL), rotates a lane's shard at a byte or sample budget,
writes each shard (a :class:`~hsx.shards.writer.ShardWriter`) under a hidden staging name, fsyncs,
commits it to the manifest, and only then renames it to its visible name: a reader that lists the
directory (pandas, pyarrow, datasets) never sees a shard the manifest does not commit.
"""

from __future__ import annotations

import errno
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hsx.errors import ShardError
from hsx.shards import format as fmt
from hsx.shards.manifest import (ErrorRecord, Manifest, ShardEntry, fsync_dir, publish, save_manifest, staged_name,
                                 streamed_checksum)
from hsx.shards.writer import Record, ShardStats, ShardWriter
from hsx.storage.store import StoreError, as_path, is_remote, spool_file

DEFAULT_LANES = min(4, os.cpu_count() or 1)  # BackgroundSink's lanes: the pipeline's parallel shard writers
ROW_GROUP_BYTES = 64 << 20  # records' bytes per row group (with several lanes, per shard)


SHARDS_PER_FOLDER = 4096  # well under the ~10K files a folder should hold (HF Hub), staged copies included


def shard_name(index: int) -> str:
    """The ``index``-th shard's file: ``shard-00000.parquet`` .. ``shard-04095.parquet`` in the output's
    folder, then 4,096 a folder: ``part-0001/shard-04096.parquet`` and on."""
    return fan_out(f"shard-{index:05d}.parquet", index)


def fan_out(name: str, index: int) -> str:
    """``name`` in the folder of the ``index``-th of its kind (4,096 a folder; the first ones at the top)."""
    folder = index // SHARDS_PER_FOLDER
    return f"part-{folder:04d}/{name}" if folder else name


class _WriteFailed(Exception):
    """A lane's write failed; :meth:`ShardSink._surfacing` turns it into the ShardError callers see."""

    def __init__(self, shard: str, error: OSError, written: int):
        super().__init__(shard, error, written)
        self.shard, self.error, self.written = shard, error, written


SHARD_NAME = re.compile(r"(?:part-\d{4,}/)?shard-(\d{5,})\.parquet")


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
            lane.writer = ShardWriter(spool_file(self._staging(lane.name)), self.manifest.metadata, self.piece_bytes)
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

    def _staging(self, name: str) -> Path:
        """Where shard ``name`` is staged; its folder (a fanned-out one, see :func:`shard_name`) made durably."""
        path = self.dir / staged_name(name)
        if not is_remote(path) and not path.parent.is_dir():
            path.parent.mkdir(exist_ok=True)  # Ray workers share the folders
            fsync_dir(self.dir)
        return path

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
