"""Writing shards: one Parquet file per :class:`ShardWriter`, a directory of them per :class:`ShardSink`.

``ShardWriter`` has one write entry point (a batch of records -> one row group), creates its
file lazily on the first batch, and ``finalize()`` returns counts. ``ShardSink`` sits above it:
it buffers records up to a row-group budget, rotates shards at a byte or sample budget, writes
each shard under a temp name, fsyncs, renames, and only then commits it to the manifest.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hsx.errors import ShardError
from hsx.shards import format as fmt
from hsx.shards.manifest import ErrorRecord, Manifest, ShardEntry, file_checksum, fsync_dir, save_manifest

COMPRESSIONS = ("none", "zstd")


@dataclass
class Record:
    """One sample as it goes into a shard."""

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
    """Writes batches of :class:`Record` to one Parquet file. Use as a context manager or call ``finalize``."""

    def __init__(self, path: str | Path, metadata: Mapping, compression: str = "none"):
        if compression not in COMPRESSIONS:
            raise ShardError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
        self.path = Path(path)
        self.metadata = dict(metadata)
        self.schema = fmt.schema_for(self.metadata)
        self.dtype = fmt.dtype_of(self.metadata["dtype"])
        self.layers = [(g["name"], g["width"]) for g in self.metadata["layers"]]
        self.compression = compression
        self._writer: pq.ParquetWriter | None = None
        self._stats = ShardStats(0, 0, 0, 0)

    def _open(self) -> pq.ParquetWriter:
        hidden = [name for name, _ in self.layers]
        codec = {_leaf(self.schema.field(name)): "zstd" for name in fmt.BASE_NAMES}
        encoding = {}
        for name in hidden:
            codec[_leaf(self.schema.field(name))] = "zstd" if self.compression == "zstd" else "none"
            # The row lengths (all equal) are delta-packed ahead of the data, which stays one
            # contiguous run of row bytes: no 4-byte length before every row as PLAIN would write.
            encoding[_leaf(self.schema.field(name))] = "DELTA_LENGTH_BYTE_ARRAY"
        return pq.ParquetWriter(
            self.path,
            self.schema,
            compression=codec,
            use_dictionary=["finish_reason"],
            column_encoding=encoding,
            write_statistics=["source_index", "prompt_len", "verify_steps"],
            write_page_checksum=True,
            data_page_size=1 << 20,
        )

    def write(self, records: Sequence[Record]) -> None:
        """Write ``records`` as one row group."""
        if not records:
            return
        for r in records:
            r.wait()
        if self._writer is None:
            self._writer = self._open()
        for r in records:
            if set(r.hidden) != {n for n, _ in self.layers}:
                raise ShardError(f"sample {r.sample_id!r}: columns {sorted(r.hidden)}, shard expects {[n for n, _ in self.layers]}")
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
        for name, width in self.layers:
            arrays.append(fmt.encode_rows([r.hidden[name] for r in records], width, self.dtype))
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema), row_group_size=len(records))
        self._stats.samples += len(records)
        self._stats.rows += sum(r.num_rows for r in records)
        self._stats.tokens += sum(int(r.input_ids.numel()) for r in records)

    def finalize(self) -> ShardStats:
        """Close the file (writing an empty shard if nothing was written) and return its counts."""
        if self._writer is None:
            self._writer = self._open()
        self._writer.close()
        self._stats.bytes = self.path.stat().st_size
        return self._stats

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif self._writer is not None:
            self._writer.close()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


SHARD_NAME = re.compile(r"shard-(\d{5})\.parquet")


class ShardSink:
    """A directory of shards with a manifest; the pipeline's only way to write.

    ``add`` buffers a record; a row group is written when the buffer reaches ``row_group_bytes``;
    the shard is committed (fsync, rename, manifest) when it reaches ``max_shard_bytes`` or
    ``max_shard_samples``. Errors recorded with ``add_error`` are committed with the next shard.

    ``names`` gives the k-th shard's file name (default ``shard-00000.parquet``, numbered on from
    the manifest's shards). With ``persist=False`` shards are still written, fsynced and renamed,
    and ``manifest`` collects their entries, but no manifest file is written: a caller that owns
    the real manifest commits them (the Ray driver, for its workers).
    """

    def __init__(
        self,
        directory: str | Path,
        manifest: Manifest,
        *,
        compression: str = "none",
        max_shard_bytes: int = 512 << 20,
        max_shard_samples: int = 100_000,
        row_group_bytes: int = 64 << 20,
        names: Callable[[int], str] | None = None,
        persist: bool = True,
    ):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = manifest
        self.compression = compression
        self.max_shard_bytes = max_shard_bytes
        self.max_shard_samples = max_shard_samples
        self.row_group_bytes = row_group_bytes
        self._buffer: list[Record] = []
        self._buffer_bytes = 0
        self._writer: ShardWriter | None = None
        self._ids: list[str] = []
        self._sources: list[int] = []
        self._shard_bytes = 0
        self._pending_errors: list[ErrorRecord] = []
        self.names = names or shard_name
        self.persist = persist
        numbered = (SHARD_NAME.fullmatch(s.file) for s in manifest.shards)
        self._next = 0 if names else 1 + max((int(m.group(1)) for m in numbered if m), default=-1)

    def add(self, record: Record) -> None:
        self._buffer.append(record)
        self._buffer_bytes += record.nbytes()
        self._ids.append(record.sample_id)
        self._sources.append(int(record.source_index))
        if self._buffer_bytes >= self.row_group_bytes:
            self._flush_row_group()
        if self._shard_bytes + self._buffer_bytes >= self.max_shard_bytes or len(self._ids) >= self.max_shard_samples:
            self.commit()

    def add_error(self, sample_id: str, source_index: int, reason: str) -> None:
        self._pending_errors.append(ErrorRecord(sample_id, int(source_index), reason))

    def _flush_row_group(self) -> None:
        if not self._buffer:
            return
        if self._writer is None:
            tmp = self.dir / f".{self.names(self._next)}.tmp-{os.getpid()}"
            self._writer = ShardWriter(tmp, self.manifest.metadata, self.compression)
        self._writer.write(self._buffer)
        self._shard_bytes += self._buffer_bytes
        self._buffer, self._buffer_bytes = [], 0

    def commit(self) -> None:
        """Make everything added so far durable: close the shard, rename it, record it in the manifest."""
        self._flush_row_group()
        if self._writer is not None:
            tmp = self._writer.path
            stats = self._writer.finalize()
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            final = self.dir / self.names(self._next)
            os.replace(tmp, final)
            fsync_dir(self.dir)
            self.manifest.shards.append(
                ShardEntry(final.name, stats.samples, stats.rows, stats.tokens, stats.bytes, file_checksum(final),
                           list(self._ids), list(self._sources))
            )
            self._next += 1
            self._writer, self._ids, self._sources, self._shard_bytes = None, [], [], 0
        self.manifest.errors.extend(self._pending_errors)
        self._pending_errors = []
        if self.persist:
            save_manifest(self.dir, self.manifest)

    def close(self, complete: bool = True) -> Manifest:
        """Commit what is left and mark the output complete."""
        self.manifest.complete = complete
        self.commit()
        return self.manifest

    def __enter__(self) -> "ShardSink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
