"""The hidden-state cells of a shard: how one column's cells hold a sample's ``[rows, W]`` block.

Hidden-state columns are ``list<large_binary>`` in one of two layouts, named by the metadata's
``codec`` (docs/FORMAT.md gives them byte by byte):

- rows (``none``, ``zstd``; every version before 4): one binary value per stored row, exactly
  ``W * itemsize`` bytes, the row's W values in the stored dtype, little-endian. A block of rows
  is one zero-copy ``[rows, W]`` view of the Arrow buffer.
- planes (``planes-zstd``, the default): ``itemsize`` binary values per sample (per piece of a long
  one), value k holding byte k of every value of the block in row-major order. Byte 1 of a
  bfloat16 (sign, 7 exponent bits) is highly repetitive and byte 0 is nearly random: apart, zstd
  squeezes the first and leaves the second, where interleaved it does worse on both. Parquet
  compresses the pages with zstd across samples (a shared prompt prefix is found again).

Both are bit-exact for the lossless dtypes (bfloat16 kept as its 16-bit pattern; Arrow has no
bfloat16); the lossy dtypes of version 5 (:class:`QuantCells`) store codes and scales. All store
the column as BYTE_ARRAY pages in DELTA_LENGTH_BYTE_ARRAY encoding: the equal lengths pack into a
few bytes and the data stays contiguous, with one repetition level per value, not per float.

Reading decodes into memory the caller allocates where it can (:meth:`Cells.decode_into`): a long
sample's pieces land one at a time in a tensor allocated once, and the lossy dtypes dequantise a few
rows at a time.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pyarrow as pa
import torch

from hsx.errors import ShardError
from hsx.shards import quant
from hsx.shards.format import (CODECS, DEFAULT_CODEC, DTYPE_NAMES, LOSSY, READ_DTYPE_OF_LOSSY, codec_of, dtype_of,
                               row_bytes)
from hsx.shards.readonly import read_only


class Cells:
    """How one hidden column's cells hold a sample's ``[rows, W]`` block (the layout of its codec)."""

    def __init__(self, width: int, dtype: torch.dtype, planes: bool):
        self.width, self.dtype, self.planes = width, dtype, planes
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = width * self.itemsize
        self.stored_row_bytes = self.row_bytes
        self.plane_row_bytes = [width] * self.itemsize  # planes: bytes a row takes in each of a piece's values

    @classmethod
    def of(cls, metadata: Mapping, group: Mapping) -> "Cells":
        planes = CODECS[codec_of(metadata)][1] == "planes"
        if metadata["dtype"] in LOSSY:
            return QuantCells(group["width"], metadata["dtype"], planes)
        return cls(group["width"], dtype_of(metadata["dtype"]), planes)

    # -- writing

    def encode(self, parts: list[torch.Tensor]) -> pa.ChunkedArray:
        """``[rows_i, W]`` tensors (one per sample) -> a ``list<large_binary>`` column, one chunk per sample.

        Rows: each chunk wraps its tensor's bytes as they are (no copy). Planes: one transposing
        copy per sample. The Parquet writer streams the chunks into one row group; concatenating
        first would cost a full extra pass over fresh memory.
        """
        chunks = []
        for p in parts:
            if p.dtype != self.dtype or p.dim() != 2 or p.shape[1] != self.width:
                raise ShardError(f"hidden rows of shape {tuple(p.shape)} {p.dtype}; column expects [rows, {self.width}] {self.dtype}")
            rows = p.shape[0]
            raw = p.contiguous().view(torch.uint8).numpy().reshape(rows, self.row_bytes) if rows else np.zeros((0, self.row_bytes), np.uint8)
            if self.planes:
                data = _split(raw.reshape(-1).view(_UINT[self.itemsize]), self.itemsize)  # [itemsize, rows * W]
                values, lengths = self.itemsize, rows * self.width
            else:
                data, values, lengths = raw, rows, self.row_bytes
            chunks.append(_cell(np.arange(values + 1, dtype=np.int64) * lengths, data))
        return pa.chunked_array(chunks, type=pa.list_(pa.large_binary()))

    # -- reading

    def rows(self, column: pa.ListArray) -> np.ndarray:
        """Stored rows of each sample of a column chunk, [S] int64."""
        counts = np.diff(column.offsets.to_numpy()).astype(np.int64)
        if not self.planes:
            return counts
        if not len(column):
            return np.zeros(0, np.int64)
        offs, value_offs = column.offsets.to_numpy(), _value_offsets(column.values)
        return np.diff(value_offs[offs]) // self.stored_row_bytes  # a cell's bytes, over all its pieces

    def check(self, column: pa.ListArray, where: str, name: str) -> None:
        """Every value of the chunk has the length its layout requires."""
        if not len(column):
            return
        self.check_lengths(*_value_lengths(column), where, name)

    def check_lengths(self, offs: np.ndarray, lengths: np.ndarray, where: str, name: str) -> None:
        """:meth:`check` of a chunk given as its list offsets and the byte length of each of its values."""
        if not self.planes:
            bad = np.flatnonzero(lengths != self.row_bytes)
            if len(bad):
                raise ShardError(f"{where}: column {name!r} has a {int(lengths[bad[0]])}-byte row; metadata "
                                 f"says width {self.width} x {DTYPE_NAMES[self.dtype]} = {self.row_bytes} bytes per row")
            return
        per_sample = np.diff(offs)
        bad = np.flatnonzero((per_sample == 0) | (per_sample % self.itemsize != 0))
        if len(bad):
            j = int(bad[0])
            raise ShardError(f"{where}: column {name!r}, sample {j} of a row group: {int(per_sample[j])} byte planes, "
                             f"{DTYPE_NAMES[self.dtype]} has {self.itemsize} (per piece)")
        planes = lengths.reshape(-1, self.itemsize)  # one row per piece
        bad = np.flatnonzero((planes != planes[:, :1]).any(axis=1) | (planes[:, 0] % self.width != 0))
        if len(bad):
            raise ShardError(f"{where}: column {name!r}, piece {int(bad[0])} of a row group: byte planes of "
                             f"{planes[bad[0]].tolist()} bytes; each must hold rows x {self.width} bytes")

    def sample(self, column: pa.ListArray, index: int) -> torch.Tensor:
        """Sample ``index`` of a column chunk as a read-only ``[rows, W]`` tensor (a view for rows)."""
        return self.block(column.slice(index, 1))

    def block(self, column: pa.ListArray) -> torch.Tensor:
        """Every row of a column chunk's samples, in order, as one read-only ``[R, W]`` tensor.

        Rows: a zero-copy view of the Arrow buffer. Planes: decoded into fresh memory.
        """
        if not self.planes:
            offs = column.offsets.to_numpy()
            start, stop = (int(offs[0]), int(offs[-1])) if len(column) else (0, 0)
            return block_view(column.values, start, stop, self.width, self.dtype)
        out = torch.empty((int(self.rows(column).sum()), self.width), dtype=self.dtype)
        self.decode_into(column, out)
        return read_only(out)

    def decode_into(self, column: pa.ListArray, out: torch.Tensor) -> None:
        """Every row of a column chunk's samples, in order, written into ``out``: a contiguous ``[R, W]``
        tensor of this column's read dtype with exactly the chunk's R rows (the decode of :meth:`block`
        without its allocation, so a long sample's pieces land in one tensor allocated once)."""
        if out.dtype != self.dtype or out.dim() != 2 or out.shape[1] != self.width or not out.is_contiguous():
            raise ShardError(f"decode target of shape {tuple(out.shape)} {out.dtype}; column decodes to "
                             f"[rows, {self.width}] {self.dtype}")
        offs = column.offsets.to_numpy()
        start, stop = (int(offs[0]), int(offs[-1])) if len(column) else (0, 0)
        target = out.view(torch.uint8).numpy().reshape(-1)
        if not self.planes:
            src = block_view(column.values, start, stop, self.width, self.dtype)
            if src.shape[0] != out.shape[0]:
                raise ShardError(f"a column chunk of {src.shape[0]} rows decoded into {out.shape[0]}")
            with torch._C.DisableTorchFunctionSubclass():
                np.copyto(target, src.view(torch.uint8).numpy().reshape(-1))
            return
        value_offs = _value_offsets(column.values)
        data = column.values.buffers()[2] if len(column.values) else None
        target = target.view(_UINT[self.itemsize])
        at = 0
        for v in range(start, stop, self.itemsize):  # one piece a step: its planes are one run of bytes
            n = int(value_offs[v + 1] - value_offs[v])  # values in the piece
            if n:
                if at + n > len(target):
                    break
                planes = np.frombuffer(data, np.uint8, count=self.itemsize * n, offset=int(value_offs[v]))
                _join(planes.reshape(self.itemsize, n), target[at:at + n])
            at += n
        if at != len(target):
            raise ShardError(f"a column chunk of {at // self.width} rows decoded into {out.shape[0]}")

    def sample_rows(self, column: pa.ListArray, index: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop-1`` of sample ``index`` of a column chunk, decoded alone (the rest of the
        sample is not decoded): rows layout, the values of those rows (a view for lossless dtypes);
        planes, the same byte ranges cut out of each piece's values."""
        offs = column.offsets.to_numpy()
        first, last = int(offs[index]), int(offs[index + 1])
        if stop <= start:
            return read_only(torch.empty((0, self.width), dtype=self.dtype))
        if not self.planes:
            if type(self) is Cells:
                return block_view(column.values, first + start, first + stop, self.width, self.dtype)
            return self.block(_cell_of(column.values.slice(first + start, stop - start)))
        value_offs = _value_offsets(column.values)
        data = column.values.buffers()[2]
        parts, at = [], 0  # the requested rows of each piece, as the piece's values would hold them
        per = len(self.plane_row_bytes)
        for v in range(first, last, per):
            n = int(value_offs[v + 1] - value_offs[v]) // self.plane_row_bytes[0]  # the piece's rows
            a, b = max(start, at) - at, min(stop, at + n) - at
            if a < b:
                for k, size in enumerate(self.plane_row_bytes):
                    begin = int(value_offs[v + k]) + a * size
                    parts.append(data[begin:begin + (b - a) * size])
            at += n
        lengths = np.array([0] + [p.size for p in parts], np.int64)
        joined = np.concatenate([np.frombuffer(p, np.uint8) for p in parts]) if parts else np.zeros(0, np.uint8)
        values = pa.Array.from_buffers(pa.large_binary(), len(parts), [None, pa.py_buffer(np.cumsum(lengths)),
                                                                      pa.py_buffer(joined)])
        return self.block(_cell_of(values))


class QuantCells(Cells):
    """Cells of a lossy dtype (docs/FORMAT.md, version 5): int8 or e4m3 codes and bfloat16 group scales.

    Planes: three values per sample, the codes of the ``[rows, W]`` block (one byte a value, row-major),
    then byte 0 and byte 1 of its ``[rows, G]`` scales. Rows: one value per row, its W codes then its G
    scales (2 bytes each, little-endian). Blocks decode to bfloat16.
    """

    def __init__(self, width: int, kind: str, planes: bool):
        super().__init__(width, READ_DTYPE_OF_LOSSY, planes)
        self.kind, self.groups = kind, quant.groups(width)
        self.stored_row_bytes = row_bytes(width, kind)
        self.plane_row_bytes = [width, self.groups, self.groups]  # codes, scale bytes 0 and 1

    def encode(self, parts: list[torch.Tensor]) -> pa.ChunkedArray:
        chunks = []
        for p in parts:
            if not p.is_floating_point() or p.dim() != 2 or p.shape[1] != self.width:
                raise ShardError(f"hidden rows of shape {tuple(p.shape)} {p.dtype}; column expects [rows, {self.width}] floats")
            try:
                codes, scale = quant.quantize(p, self.kind)
            except ValueError as e:
                raise ShardError(f"{self.kind} column of width {self.width}: {e}") from None
            rows = p.shape[0]
            c = codes.view(torch.uint8).numpy()
            sc = scale.view(torch.uint8).numpy().reshape(rows, self.groups * 2)
            if self.planes:
                s16 = sc.reshape(-1).view(np.uint16)
                data = np.concatenate([c.reshape(-1), _split(s16, 2).reshape(-1)])
                offsets = np.cumsum(np.array([0, rows * self.width, rows * self.groups, rows * self.groups], np.int64))
            else:
                data = np.concatenate([c, sc], axis=1)
                offsets = np.arange(rows + 1, dtype=np.int64) * self.stored_row_bytes
            chunks.append(_cell(offsets, data))
        return pa.chunked_array(chunks, type=pa.list_(pa.large_binary()))

    def check_lengths(self, offs: np.ndarray, lengths: np.ndarray, where: str, name: str) -> None:
        if not self.planes:
            bad = np.flatnonzero(lengths != self.stored_row_bytes)
            if len(bad):
                raise ShardError(f"{where}: column {name!r} has a {int(lengths[bad[0]])}-byte row; metadata says width "
                                 f"{self.width} x {self.kind} = {self.stored_row_bytes} bytes per row (scales included)")
            return
        per_sample = np.diff(offs)
        bad = np.flatnonzero((per_sample == 0) | (per_sample % 3 != 0))
        if len(bad):
            j = int(bad[0])
            raise ShardError(f"{where}: column {name!r}, sample {j} of a row group: {int(per_sample[j])} values; "
                             f"a {self.kind} cell holds 3 a piece (codes, scale bytes 0 and 1)")
        v = lengths.reshape(-1, 3)  # one row per piece
        rows = v[:, 0] // self.width
        bad = np.flatnonzero((v[:, 0] % self.width != 0) | (v[:, 1] != rows * self.groups) | (v[:, 2] != v[:, 1]))
        if len(bad):
            raise ShardError(f"{where}: column {name!r}, piece {int(bad[0])} of a row group: values of "
                             f"{v[bad[0]].tolist()} bytes; expected rows x {self.width} codes and 2 x rows x {self.groups} scale bytes")

    def block(self, column: pa.ListArray) -> torch.Tensor:
        out = torch.empty((int(self.rows(column).sum()), self.width), dtype=self.dtype)
        self.decode_into(column, out)
        return read_only(out)

    def decode_into(self, column: pa.ListArray, out: torch.Tensor) -> None:
        """Dequantised, a few rows at a time (the float temporaries of :func:`quant.dequantize` stay
        small whatever the chunk's size), into ``out`` (see :meth:`Cells.decode_into`)."""
        if out.dtype != self.dtype or out.dim() != 2 or out.shape[1] != self.width or not out.is_contiguous():
            raise ShardError(f"decode target of shape {tuple(out.shape)} {out.dtype}; column decodes to "
                             f"[rows, {self.width}] {self.dtype}")
        offs = column.offsets.to_numpy()
        start, stop = (int(offs[0]), int(offs[-1])) if len(column) else (0, 0)
        value_offs = _value_offsets(column.values)
        data = column.values.buffers()[2] if len(column.values) else None
        if stop == start or data is None:
            if out.shape[0]:
                raise ShardError(f"a column chunk of 0 rows decoded into {out.shape[0]}")
            return
        first, last = int(value_offs[start]), int(value_offs[stop])
        raw = np.frombuffer(data, np.uint8, count=last - first, offset=first)
        if not self.planes:
            rows = raw.reshape(-1, self.stored_row_bytes)
            if len(rows) != out.shape[0]:
                raise ShardError(f"a column chunk of {len(rows)} rows decoded into {out.shape[0]}")
            self._dequantize_into(rows[:, :self.width], rows[:, self.width:], out)
            return
        at = 0
        for v in range(start, stop, 3):  # one piece per step: three slices, no per-value work
            a, b, c, d = (int(value_offs[v + k]) - first for k in range(4))
            n = (b - a) // self.width
            if at + n > out.shape[0]:
                break
            self._dequantize_into(raw[a:b].reshape(n, self.width), _scales(raw[b:c], raw[c:d], n, self.groups),
                                  out[at:at + n])
            at += n
        if at != out.shape[0]:
            raise ShardError(f"a column chunk of {at} rows decoded into {out.shape[0]}")

    def _dequantize_into(self, codes: np.ndarray, scale: np.ndarray, out: torch.Tensor) -> None:
        """Codes ``[R, W]`` (uint8) and scales ``[R, G]`` (little-endian bfloat16: uint16, or their ``2G`` bytes)
        -> ``out`` ``[R, W]`` (any float dtype: the bfloat16 values, converted exactly), ``DEQUANT_VALUES``
        values a step. Row by row the same arithmetic as one :func:`quant.dequantize` of the whole block."""
        code_dtype = quant.CODES[self.kind][0]
        step = max(1, DEQUANT_VALUES // max(1, self.width))
        for a in range(0, len(codes), step):
            c, s = codes[a:a + step], scale[a:a + step]
            c = _as_torch(np.ascontiguousarray(c)).view(code_dtype)
            s = _as_torch(np.ascontiguousarray(s).reshape(len(s), -1).view(np.uint16)).view(quant.SCALE_DTYPE)
            out[a:a + len(c)] = quant.dequantize(c, s, self.dtype)


# Values dequantised at a time (QuantCells): a few MB of float32 temporaries, whatever the sample's size.
DEQUANT_VALUES = 1 << 20


def _scales(low: np.ndarray, high: np.ndarray, rows: int, groups: int) -> np.ndarray:
    """A planes cell's two scale byte planes -> ``[rows, groups]`` uint16 (the bfloat16 bit patterns)."""
    s16 = np.empty(len(low), np.uint16)
    _join(np.stack([low, high]), s16)
    return s16.reshape(rows, groups)


def _as_torch(a: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of an array that may be read-only Arrow memory (only read from here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _cell(offsets: np.ndarray, data: np.ndarray) -> pa.ListArray:
    """One sample's cell: a list of the ``large_binary`` values that ``offsets`` cut out of ``data``."""
    values = pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1,
                                   [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(data).reshape(-1))])
    return pa.ListArray.from_arrays(pa.array(np.array([0, len(offsets) - 1], dtype=np.int32)), values)


def _cell_of(values: pa.Array) -> pa.ListArray:
    """One cell holding ``values`` (``large_binary``)."""
    return pa.ListArray.from_arrays(pa.array(np.array([0, len(values)], dtype=np.int32)), values)


def _value_lengths(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """A column chunk's list offsets and the byte length of each of its binary values."""
    offs = column.offsets.to_numpy()
    return offs, np.diff(_value_offsets(column.values)[offs[0]:offs[-1] + 1])


def _split(values: np.ndarray, itemsize: int) -> np.ndarray:
    """Unsigned integers [n] -> their byte planes [itemsize, n], little-endian byte k in plane k."""
    planes = np.empty((itemsize, len(values)), np.uint8)
    for k in range(itemsize):
        planes[k] = values >> (8 * k) if k else values  # assignment casts to uint8: keeps byte k
    return planes


def _join(planes: np.ndarray, out: np.ndarray) -> None:
    """Byte planes [itemsize, n] -> unsigned integers [n] in ``out`` (the inverse of :func:`_split`)."""
    out[:] = planes[-1]
    for k in range(len(planes) - 2, -1, -1):
        out <<= 8
        out |= planes[k]


def column_rows(column: pa.ChunkedArray, metadata: Mapping, group: Mapping) -> np.ndarray:
    """Stored rows of each sample of a hidden column (all chunks), [S] int64."""
    cells = Cells.of(metadata, group)
    return np.concatenate([cells.rows(c) for c in column.chunks]) if column.num_chunks else np.zeros(0, np.int64)


def decode(cell, width: int, dtype: str = "bfloat16", codec: str = DEFAULT_CODEC) -> np.ndarray:
    """One sample's cell of a hidden column, as pandas or pyarrow give it, -> ``[rows, W]`` numpy array.

    ``cell`` is the sequence of ``bytes`` (pandas: an object array; pyarrow: ``ListScalar.as_py()``).
    A long sample (format 6) spans several Parquet rows, its pieces in ``first_row`` order: pass one
    piece's cell for its rows, or the pieces' cells chained (``[v for c in cells for v in c]``) for all.
    A lossy dtype (``int8``, ``float8_e4m3``) comes back dequantised, as float32. bfloat16 comes back as its uint16 bit patterns (numpy has no bfloat16): ``torch.from_numpy(a).view(
    torch.bfloat16)``. ``codec`` and ``dtype`` are in the shard's metadata (``hsx.open(path).metadata``).
    The array is allocated once and each piece decoded straight into its rows: besides the cell, the
    memory is the result (a lossy cell's floats are dequantised a few rows at a time).
    """
    if dtype in LOSSY:
        return _decode_lossy(cell, width, dtype, codec)
    kind = dtype_of(dtype)
    np_dtype = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32}[kind]
    size = np.dtype(np_dtype).itemsize
    values = [np.frombuffer(v, np.uint8) for v in cell]  # views of the caller's bytes
    if CODECS[codec_of({"codec": codec})][1] == "rows":
        return (np.concatenate(values) if values else np.zeros(0, np.uint8)).view(np_dtype).reshape(-1, width)
    pieces = [values[k:k + size] for k in range(0, len(values), size)]
    if not pieces or any(len(p) != size or len({len(v) for v in p}) != 1 for p in pieces):
        raise ShardError(f"a {codec} cell of {dtype} holds {size} equal byte planes a piece; got lengths {[len(v) for v in values]}")
    # the output allocated once, each piece's planes interleaved straight into its rows
    out = np.empty((sum(len(p[0]) for p in pieces), size), np.uint8)
    at = 0
    for p in pieces:
        np.stack(p, axis=-1, out=out[at:at + len(p[0])])
        at += len(p[0])
    return out.reshape(-1).view(np_dtype).reshape(-1, width)


def _decode_lossy(cell, width: int, dtype: str, codec: str) -> np.ndarray:
    values = [np.frombuffer(v, np.uint8) for v in cell]  # views of the caller's bytes
    cells = QuantCells(width, dtype, CODECS[codec_of({"codec": codec})][1] == "planes")
    lengths = np.array([len(v) for v in values], np.int64)
    cells.check_lengths(np.array([0, len(values)]), lengths, "decode", f"{dtype} cell")
    if not cells.planes:  # one value a row: its W codes, then its G scales
        out = torch.empty((len(values), width), dtype=torch.float32)
        step = max(1, DEQUANT_VALUES // max(1, width))
        for a in range(0, len(values), step):
            rows = np.stack(values[a:a + step]) if values[a:a + step] else np.zeros((0, cells.stored_row_bytes), np.uint8)
            cells._dequantize_into(rows[:, :width], rows[:, width:], out[a:a + len(rows)])
        return out.numpy()
    out = torch.empty((int(lengths[0::3].sum()) // width, width), dtype=torch.float32)
    at = 0
    for k in range(0, len(values), 3):  # one piece: codes, scale bytes 0 and 1
        n = len(values[k]) // width
        cells._dequantize_into(values[k].reshape(n, width), _scales(values[k + 1], values[k + 2], n, cells.groups),
                               out[at:at + n])
        at += n
    return out.numpy()


def block_view(values: pa.Array, start: int, stop: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[start, stop)`` of a rows-layout column's values as a zero-copy, read-only ``[rows, W]`` tensor.

    ``values`` is ``large_binary`` (versions 2-4: every value is one row long, see
    :meth:`Cells.check`) or ``fixed_size_binary`` (version 1).
    """
    row_bytes = width * torch.empty((), dtype=dtype).element_size()
    rows = stop - start
    if pa.types.is_fixed_size_binary(values.type):
        if values.type.byte_width != row_bytes:
            raise ShardError(f"column stores {values.type.byte_width}-byte rows; metadata says {width} x {dtype}")
        buf, offset = values.buffers()[1], (values.offset + start) * row_bytes
    else:
        offs = _value_offsets(values)[start:stop + 1]
        if rows and int(offs[-1] - offs[0]) != rows * row_bytes:
            raise ShardError(f"rows {start}..{stop - 1} span {int(offs[-1] - offs[0])} bytes; metadata says "
                             f"{rows} x {width} x {dtype} = {rows * row_bytes}")
        buf, offset = values.buffers()[2], int(offs[0]) if rows else 0
    if rows == 0:
        return read_only(torch.empty((0, width), dtype=dtype))
    t = _frombuffer(buf, dtype, rows * width, offset)
    return read_only(t.view(rows, width))


def _value_offsets(values: pa.Array) -> np.ndarray:
    """The int64 value offsets of a ``large_binary`` array (zero-copy)."""
    return np.frombuffer(values.buffers()[1], dtype=np.int64, count=len(values) + 1, offset=values.offset * 8)


def check_row_bytes(table: pa.Table, meta: Mapping, where: str) -> None:
    """Every hidden cell has the lengths its layout requires (versions 2-4).

    Version 1 types carry the width (``fixed_size_binary``) and were checked with the schema.
    """
    if meta.get("format_version") == 1:
        return
    for g in meta["layers"]:
        cells = Cells.of(meta, g)
        for chunk in table.column(g["name"]).chunks:
            cells.check(chunk, where, g["name"])


def _frombuffer(buf: pa.Buffer, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        # torch warns that the Arrow buffer is not writable; block_view wraps the view in a
        # ReadOnlyTensor, which refuses in-place writes.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
