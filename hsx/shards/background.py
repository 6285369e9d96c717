"""A :class:`~hsx.shards.sink.ShardSink` run on one writer thread, so that encoding, writing and
fsyncing shards overlap with the engine instead of stalling it.

Every call becomes an operation on a queue that the writer thread executes in order on a real
``ShardSink``: row groups, shard rotation, error records and commits happen exactly as they would
synchronously, and the files and manifest are byte for byte the same. The queue is bounded by the
bytes of the records it holds, so memory stays bounded when the disk is slower than the engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hsx.errors import ShardError
from hsx.shards.manifest import Manifest
from hsx.shards.sink import DEFAULT_LANES, ShardSink
from hsx.shards.writer import Record


@dataclass
class WriterStats:
    blocked_s: float = 0.0  # caller time spent waiting in ``add`` for the queue to drain (backpressure)
    busy_s: float = 0.0  # writer-thread time spent executing operations (encode, write, fsync, manifest)
    peak_pending_bytes: int = 0  # most record bytes queued at once
    records: int = 0


class BackgroundSink:
    """Drop-in for :class:`ShardSink` (same constructor arguments, plus ``max_pending_bytes``; ``lanes``
    left out or None is ``DEFAULT_LANES`` here).

    The writer thread hands each row group to one of the sink's ``lanes`` (shards encoded and
    compressed in parallel, each lane on a thread of its own, one row group in flight per lane).

    ``add`` and ``add_error`` return once the call is queued; ``add`` blocks while the records
    queued and not yet handed to the shard writer exceed ``max_pending_bytes`` (one record larger
    than the bound still goes through, alone). The default, two row groups, lets the engine fill
    the next row group while the writer thread fills one, with a row group of slack for a shard
    commit's fsync; the sink's own row-group buffer and one row group per lane come on top, so at
    most about ``3 + lanes`` row groups of records are held.

    ``commit`` and ``close`` return after the writer thread has done them. A failure on the writer
    thread is raised as :class:`ShardError` by the next call, chained to the original error; after
    it nothing more is written, and the manifest is never marked complete. Read ``manifest`` after
    ``commit`` or ``close``: the writer thread appends to it.
    """

    def __init__(self, directory: str | Path, manifest: Manifest, *, max_pending_bytes: int | None = None,
                 lanes: int | None = None, **sink_options):
        lanes = DEFAULT_LANES if lanes is None else lanes
        self._sink = ShardSink(directory, manifest, lanes=lanes, **sink_options)
        self.lanes = lanes
        self.max_pending_bytes = 2 * self._sink.row_group_bytes if max_pending_bytes is None else max_pending_bytes
        self.stats = WriterStats()
        self._cond = threading.Condition()
        self._ops: deque[tuple[Callable[[], None], int, bool]] = deque()  # (operation, record bytes, stops the thread)
        self._pending_bytes = 0
        self._queued = 0  # operations queued so far; the k-th has ticket k
        self._done = 0  # operations finished (or dropped after a failure)
        self._failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"hsx-shard-writer:{self._sink.dir}", daemon=True)
        self._thread.start()

    @property
    def manifest(self) -> Manifest:
        return self._sink.manifest

    @property
    def dir(self) -> Path:
        return self._sink.dir

    @property
    def pending_bytes(self) -> int:
        """Bytes of records queued or being handed to the shard writer right now."""
        return self._pending_bytes

    def add(self, record: Record) -> None:
        n = record.nbytes()
        with self._cond:
            self._check()
            if self._pending_bytes and self._pending_bytes + n > self.max_pending_bytes:
                t0 = time.perf_counter()
                while self._failure is None and self._pending_bytes and self._pending_bytes + n > self.max_pending_bytes:
                    self._cond.wait()
                self.stats.blocked_s += time.perf_counter() - t0
            self.stats.records += 1
            self._put(lambda: self._sink.add(record), n)

    def add_error(self, sample_id: str, source_index: int, reason: str) -> None:
        with self._cond:
            self._put(lambda: self._sink.add_error(sample_id, source_index, reason))

    def commit(self) -> None:
        """Make everything added so far durable; returns after the commit is done."""
        with self._cond:
            self._wait_for(self._put(self._sink.commit))

    def close(self, complete: bool = True) -> Manifest:
        """Drain the queue, commit what is left (marking the output ``complete``), stop the thread."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._put(lambda: self._sink.close(complete), stop=True)
        self._thread.join()
        with self._cond:
            self._check()
        return self._sink.manifest

    def __enter__(self) -> "BackgroundSink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # As with ShardSink: what the calls so far committed stays committed, nothing else is.
        with self._cond:
            if not self._closed:
                self._closed = True
                self._put(self._sink.abort, stop=True, check=False)
        self._thread.join()

    # The caller's side; these run with self._cond held.

    def _check(self) -> None:
        if self._failure is not None:
            raise ShardError(f"{self._sink.dir}: the shard writer failed, nothing after the failure was written "
                             f"({type(self._failure).__name__}: {self._failure})") from self._failure

    def _put(self, op: Callable[[], None], nbytes: int = 0, *, stop: bool = False, check: bool = True) -> int:
        if check:
            self._check()
            if self._closed and not stop:
                raise ShardError(f"{self._sink.dir}: the shard sink is closed")
        self._ops.append((op, nbytes, stop))
        self._pending_bytes += nbytes
        self.stats.peak_pending_bytes = max(self.stats.peak_pending_bytes, self._pending_bytes)
        self._queued += 1
        self._cond.notify_all()
        return self._queued

    def _wait_for(self, ticket: int) -> None:
        while self._done < ticket:
            self._cond.wait()
        self._check()

    # The writer thread.

    def _run(self) -> None:
        while True:
            with self._cond:
                idle = not self._ops
            queued = not (idle and self._sink.in_flight())
            if not queued:
                # nothing queued: finish the lanes' writes, so that a failure surfaces now
                op, nbytes, stop = self._sink.drain, 0, False
            else:
                with self._cond:
                    while not self._ops:
                        self._cond.wait()
                    op, nbytes, stop = self._ops.popleft()
            t0 = time.perf_counter()
            try:
                op()
                error = None
            except BaseException as e:  # surfaced in the caller; the thread must not die silently
                error = e
            self.stats.busy_s += time.perf_counter() - t0
            with self._cond:
                self._pending_bytes -= nbytes
                self._done += queued
                if error is not None:
                    self._fail(error)
                self._cond.notify_all()
            if error is not None:
                self._sink.abort()  # the lanes' partial shards go; committed ones stay
            if stop or error is not None:
                return

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        self._sink.manifest.complete = False  # ShardSink.close sets it before it commits
        # Nothing queued behind the failure runs; release it so that no caller waits on it.
        while self._ops:
            _, nbytes, _ = self._ops.popleft()
            self._pending_bytes -= nbytes
            self._done += 1
