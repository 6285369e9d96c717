"""Writing one shard: :class:`ShardWriter`, a batch of :class:`Record` at a time into one Parquet file.

``ShardWriter`` has one write entry point (a batch of records -> one row group), creates its
file lazily on the first batch, and ``finalize()`` returns counts. Rotating shards, staging,
uploading and committing them to the manifest live one layer above, in :mod:`hsx.shards.sink`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hsx.errors import ShardError
from hsx.shards import format as fmt
from hsx.shards import positions
from hsx.shards.cells import Cells


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
    # a vision-language sample: image_mask [N] uint8, images (list of dicts), mrope_positions [3, N] or None,
    # rope_delta int or None (hsx.shards.format.VISION_FIELDS)
    vision: Mapping | None = field(default=None, compare=False)

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
        if fmt.IMAGE_MASK.name in self.schema.names:
            arrays.extend(self._vision_arrays(records))
        for name, _ in self.layers:
            arrays.append(self.cells[name].encode([r.hidden[name] if b is None else r.hidden[name][a:b] for r, a, b in parts]))
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema), row_group_size=len(parts))

    def _vision_arrays(self, records: Sequence[Record]) -> list[pa.Array]:
        """The vision columns of a row group: every record of a vision-language run carries them."""
        missing = [r.sample_id for r in records if r.vision is None]
        if missing:
            raise ShardError(f"sample {missing[0]!r}: a vision-language shard needs its image columns; the record has none")
        vis = [r.vision for r in records]
        for r, v in zip(records, vis, strict=True):
            if v["image_mask"].numel() != r.input_ids.numel():
                raise ShardError(f"sample {r.sample_id!r}: image_mask of {v['image_mask'].numel()} tokens for "
                                 f"{r.input_ids.numel()} input_ids")
        mrope = [v["mrope_positions"] for v in vis]
        mrope_arr = _int_lists([m if m is not None else torch.zeros(0, dtype=torch.int32) for m in mrope], pa.int32(), np.int32)
        if any(m is None for m in mrope):
            mrope_arr = pa.ListArray.from_arrays(mrope_arr.offsets, mrope_arr.values, mask=pa.array([m is None for m in mrope]))
        return [
            _int_lists([v["image_mask"] for v in vis], pa.uint8(), np.uint8),
            pa.array([v["images"] for v in vis], fmt.IMAGES.type),
            mrope_arr,
            pa.array([v["rope_delta"] for v in vis], pa.int32()),
        ]

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
