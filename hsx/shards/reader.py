"""Reading shards: ``hsx.open(path)`` -> :class:`ShardDataset` of :class:`Sample`.

Shards are loaded lazily, one file at a time, and checked before any number leaves them: size
and xxh3-128 checksum against the manifest (Parquet page CRCs for a file opened without one),
schema and metadata. A loaded shard holds its small columns; its hidden columns are read from the
file one row group of one column at a time, when asked for, and each row group's cells are checked
as it is read. Hidden states come out read-only and unconverted: a sample stored whole is a view of
its row group's block (decoded once and kept, or for the rows layout the Arrow buffer itself); a
long sample's pieces (format 6) are decoded one at a time straight into one tensor of its own, and
``rows=slice(a, b)`` decodes only the pieces that hold those rows.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import xxhash

from hsx.errors import HsxError, ShardError
from hsx.shards import format as fmt
from hsx.shards.manifest import ErrorRecord, ShardEntry, load_manifest, manifest_path, shard_path
from hsx.shards import positions
from hsx.shards.readonly import read_only
from hsx.shards.store import as_path, open_input


# What reading a damaged file can raise: pyarrow picks columns by the names in the Parquet schema, which
# the Arrow schema checked here does not cover (a flipped byte there is a UnicodeDecodeError or a KeyError).
_READ_ERRORS = (pa.ArrowException, OSError, ValueError, KeyError)


def _np_to_torch(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only Arrow memory
        return torch.from_numpy(a)


class _Column:
    """One column of a loaded shard with a row -> (chunk, local row) index."""

    def __init__(self, chunked: pa.ChunkedArray):
        self.chunks = [c for c in chunked.chunks if len(c)] or list(chunked.chunks[:1])
        self.starts = np.cumsum([0, *(len(c) for c in self.chunks)])

    def locate(self, row: int):
        k = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.chunks[k], row - int(self.starts[k])


class _Shard:
    """One checked shard: its small columns in memory (one row per sample, a long sample's pieces joined),
    its hidden columns read from the file when asked for, one row group of one column at a time.

    A row group of whole samples is decoded once and kept (every sample of it a view of the same memory,
    as before); the pieces of a long sample are decoded one at a time into the tensor returned and not
    kept, so a full read holds the sample once plus one piece, and a partial read one piece.
    ``cache_blocks`` bounds the row groups kept of each column, decoded and (apart) read for partial
    reads; None keeps every one the shard has read.
    """

    def __init__(self, path: Path, source: pa.NativeFile, parquet: pq.ParquetFile, raw: pa.Table, table: pa.Table,
                 metadata: dict, cache_blocks: int | None = None, page_checksums: bool = True):
        self.path = path
        self._source, self._page_checksums = source, page_checksums
        self.parquet = parquet
        self._raw = raw  # the same, a row per Parquet row
        self.meta = table  # every column but the hidden ones, a row per sample
        self.metadata = metadata
        self.cols = {name: _Column(table.column(name)) for name in table.column_names}
        self.dtypes = fmt.dtype_of(metadata["dtype"])
        self.widths = {g["name"]: g["width"] for g in metadata["layers"]}
        self.cells = {g["name"]: fmt.Cells.of(metadata, g) for g in metadata["layers"]}
        self._cache_blocks = None if cache_blocks is None else max(1, int(cache_blocks))
        self._blocks: OrderedDict[tuple[str, int], tuple] = OrderedDict()  # decoded row groups: block, row offsets, chunk
        self._chunks: OrderedDict[tuple[str, int], tuple[pa.ListArray, np.ndarray]] = OrderedDict()  # read, for partial reads
        md = parquet.metadata
        per_group = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], np.int64)
        if (per_group < 0).any() or int(per_group.sum()) != raw.num_rows:
            raise ShardError(f"{path}: {raw.num_rows} Parquet rows read, the footer's row groups hold "
                             f"{per_group.tolist()} (corrupt footer)")
        self._group_start = np.concatenate([[0], np.cumsum(per_group)]).astype(np.int64)  # Parquet rows
        self._group_of = np.repeat(np.arange(len(per_group)), per_group)  # Parquet row -> its row group
        starts = fmt.sample_starts(raw)
        self._span = (np.arange(raw.num_rows + 1) if starts is None else np.append(starts, raw.num_rows)).astype(np.int64)
        # rows each Parquet row holds, by its positions column (format 4 on); older shards: the cells' own
        self._expected = None if fmt.POSITIONS.name not in raw.column_names else \
            pa.compute.list_value_length(raw.column(fmt.POSITIONS.name)).to_numpy(zero_copy_only=False).astype(np.int64)
        whole = np.diff(self._span) == 1  # samples that are one Parquet row
        one_row = np.repeat(whole, np.diff(self._span))  # per Parquet row: its sample's only row
        # row groups of whole samples are kept once read; a long sample's pieces never are
        self._whole_group = np.array([bool(one_row[a:b].all()) for a, b in zip(self._group_start[:-1], self._group_start[1:])])
        self._version = metadata.get("format_version", fmt.FORMAT_VERSION)

    def scalar(self, name: str, row: int):
        chunk, i = self.cols[name].locate(row)
        return chunk[i].as_py()

    def int_list(self, name: str, row: int) -> torch.Tensor | None:
        chunk, i = self.cols[name].locate(row)
        if not chunk[i].is_valid:
            return None
        start, stop = chunk.offsets[i].as_py(), chunk.offsets[i + 1].as_py()
        return _np_to_torch(chunk.values.to_numpy(zero_copy_only=True)[start:stop])

    @cached_property
    def table(self) -> pa.Table:
        """The whole shard as one table, hidden columns included, pieces joined (``hsx verify``'s checks),
        kept. It holds every hidden cell at once: readers of samples use the methods below."""
        return self.whole_table()

    def whole_table(self, columns: Sequence[str] | None = None) -> pa.Table:
        """``columns`` (default: all) of the shard, one row per sample; a hidden column's chunks are the
        row groups' own Arrow arrays (those the rows layout's views point into)."""
        schema = self.parquet.schema_arrow
        names = list(columns) if columns is not None else list(schema.names)
        hidden = [n for n in names if n in self.widths]
        if not hidden:
            return self.meta.select(names)
        raw = self._raw
        arrays = [self._column(n) if n in self.widths else raw.column(n) for n in schema.names
                  if n in self.widths and n in hidden or n not in self.widths]
        whole = pa.Table.from_arrays(arrays, schema=pa.schema([f for f in schema if f.name not in self.widths
                                                               or f.name in hidden], metadata=schema.metadata))
        return fmt.join_pieces(whole, self.metadata, str(self.path)).select(names)

    def _column(self, name: str) -> pa.ChunkedArray:
        """Hidden column ``name``, a chunk per row group, a row per Parquet row (a block's own where it is kept)."""
        chunks = []
        for g in range(len(self._group_start) - 1):
            kept = self._blocks.get((name, g))
            chunks.append(kept[2] if kept is not None and kept[2] is not None else self._chunk(name, g)[0])
        return pa.chunked_array(chunks, type=self.parquet.schema_arrow.field(name).type)

    # -- hidden columns

    def _check_name(self, name: str) -> None:
        if name not in self.widths:
            raise KeyError(f"{self.path.name}: no hidden-state column {name!r}; columns: {list(self.widths)}")

    def _read(self, name: str, g: int) -> tuple[pa.ListArray, np.ndarray]:
        """Row group ``g`` of column ``name``, checked, and the rows each of its Parquet rows holds."""
        try:
            # a reader of its own, let go with the read: a ParquetFile keeps its last column chunk's
            # compressed bytes (most of a piece) until its next read
            reader = pq.ParquetFile(self._source, metadata=self.parquet.metadata,
                                    page_checksum_verification=self._page_checksums)
            col = reader.read_row_group(g, columns=[name], use_threads=False).column(0)
            del reader
            # pyarrow's default pool (mimalloc) keeps the read's freed pages (compressed and decompressed
            # pages), which reads of other sizes rarely reuse: handed back, what stays is what the data holds
            pa.default_memory_pool().release_unused()
        except _READ_ERRORS as e:
            raise ShardError(f"{self.path}: unreadable Parquet ({e})") from None
        chunk = col.chunk(0) if col.num_chunks == 1 else pa.concat_arrays(col.chunks) if col.num_chunks else \
            pa.array([], col.type)
        if len(chunk) != self._group_start[g + 1] - self._group_start[g]:
            raise ShardError(f"{self.path}: row group {g} of column {name!r} has {len(chunk)} rows, the footer says "
                             f"{int(self._group_start[g + 1] - self._group_start[g])}")
        if self._version != 1:  # version 1 types carry the width, checked with the schema
            self.cells[name].check(chunk, str(self.path), name)
        return chunk, self.cells[name].rows(chunk)

    def check_hidden(self) -> None:
        """Read every row group of every hidden column once, one at a time, checking its pages and cells
        (a long sample's pieces against their positions); row groups of whole samples are kept for the
        reads to come, as :meth:`_chunk` keeps them."""
        for name in self.widths:
            for row in np.flatnonzero(np.diff(self._span) > 1):
                for _ in self._each_piece(name, int(row), lambda *_: None):
                    pass
            for g in np.flatnonzero(self._whole_group):
                self._chunk(name, int(g))

    def _chunk(self, name: str, g: int) -> tuple[pa.ListArray, np.ndarray]:
        """:meth:`_read`, kept for the next partial read where ``g`` holds whole samples only."""
        key = (name, g)
        got = self._chunks.get(key)
        if got is not None:
            self._chunks.move_to_end(key)
            return got
        got = self._read(name, g)
        if self._whole_group[g]:
            self._keep(self._chunks, key, got)
        return got

    def _keep(self, cache: OrderedDict, key, value) -> None:
        """``cache[key] = value``, then at most ``cache_blocks`` entries of that column, the least recently used out."""
        cache[key] = value
        if self._cache_blocks is not None:
            same = [k for k in cache if k[0] == key[0]]  # least recently used first
            for k in same[:-self._cache_blocks]:
                del cache[k]

    def block(self, name: str, g: int) -> tuple[torch.Tensor, np.ndarray]:
        """Row group ``g`` of a hidden column as one ``[R, W]`` tensor and its Parquet rows' row offsets.

        Rows layout: a view of the Arrow buffer. Planes: decoded once. Either is kept with the shard, so
        that every sample of the row group is a view of the same memory, found in O(1).
        """
        key = (name, g)
        got = self._blocks.get(key)
        if got is None:
            chunk, rows = self._chunks.pop(key, None) or self._read(name, g)
            cells = self.cells[name]
            view = type(cells) is fmt.Cells and not cells.planes  # the block is a view of the chunk: keep it named
            got = cells.block(chunk), np.concatenate([[0], np.cumsum(rows)]).astype(np.int64), chunk if view else None
            if not view:
                chunk = None  # decoded: its Arrow buffers go, and their pages with them
                pa.default_memory_pool().release_unused()
            self._keep(self._blocks, key, got)
        else:
            self._blocks.move_to_end(key)
        return got[0], got[1]

    def _each_piece(self, name: str, row: int, use, within: tuple[int, int] | None = None):
        """``use(chunk, index, rows, first)`` for each Parquet row of a sample in order (``first``: its first row
        within the sample), yielding what it returns. Each row group is read once, and let go before the next
        one is read and before the last result taken from it is yielded, so that a caller holding a result
        holds no Arrow buffers with it; a piece whose cells hold other than its positions' rows is refused.
        ``within=(start, stop)``: only the Parquet rows that hold some of those rows (by their positions)."""
        a, b = int(self._span[row]), int(self._span[row + 1])
        pieces = b - a > 1
        if within is not None and self._expected is not None:
            ends = np.cumsum(self._expected[a:b])
            lo = a + int(np.searchsorted(ends, within[0], side="right"))
            hi = a + min(b - a, int(np.searchsorted(ends, within[1] - 1, side="right")) + 1)
            first = int(ends[lo - a - 1]) if lo > a else 0
            a, b = lo, max(lo, hi)
        else:
            first = 0
        chunk = rows = held = None
        for p in range(a, b):
            g = int(self._group_of[p])
            if held != g:
                chunk = rows = None  # the last piece's buffers go before the next piece is read
                chunk, rows = self._chunk(name, g)
                held = g
            i = p - int(self._group_start[g])
            n = int(rows[i])
            if self._expected is not None and n != int(self._expected[p]):
                raise ShardError(f"{self.path}: sample {self.scalar('sample_id', row)!r}: a piece of {n} rows of column "
                                 f"{name!r}, its positions column lists {int(self._expected[p])}")
            got = [use(chunk, i, n, first)]
            first += n
            if p + 1 == b or self._group_of[p + 1] != g:
                chunk = rows = held = None
                if pieces:
                    # pyarrow's default pool (mimalloc) keeps a freed read's large blocks, which the next
                    # piece's rarely fit: handed back now, they are not held while the caller works either
                    pa.default_memory_pool().release_unused()
            yield got.pop()  # not kept here while the caller works: it goes when the caller lets it go

    def _whole_sample(self, row: int) -> int | None:
        """The row group of a sample that is one Parquet row of a row group of whole samples, else None."""
        a = int(self._span[row])
        if self._span[row + 1] - a != 1:
            return None
        g = int(self._group_of[a])
        return g if self._whole_group[g] else None

    def hidden(self, name: str, row: int) -> torch.Tensor:
        self._check_name(name)
        g = self._whole_sample(row)
        if g is not None:
            block, starts = self.block(name, g)
            i = int(self._span[row]) - int(self._group_start[g])
            return block[int(starts[i]):int(starts[i + 1])]
        # a long sample: allocated once, each piece decoded into its rows and its Arrow buffers let go
        out = torch.empty((self.num_rows(row), self.widths[name]), dtype=self.dtypes)
        cells = self.cells[name]
        for _ in self._each_piece(name, row, lambda chunk, i, n, at: cells.decode_into(chunk.slice(i, 1), out[at:at + n])):
            pass
        return read_only(out)

    def hidden_pieces(self, name: str, row: int) -> Iterator[torch.Tensor]:
        """A sample's rows of column ``name``, in order, one stored piece at a time (a whole sample: one)."""
        self._check_name(name)
        if self._whole_sample(row) is not None:
            yield self.hidden(name, row)
            return
        cells = self.cells[name]
        yield from self._each_piece(name, row, lambda chunk, i, n, at: cells.sample(chunk, i))

    def hidden_rows(self, name: str, row: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop-1`` of a sample's column: a view of its row group's block where that is decoded
        already, else those rows alone, decoded from the cells of the pieces that hold them."""
        self._check_name(name)
        cells = self.cells[name]
        g = self._whole_sample(row)
        if g is not None and (name, g) in self._blocks:
            block, starts = self.block(name, g)
            i = int(self._span[row]) - int(self._group_start[g])
            if self._expected is not None and starts[i + 1] - starts[i] != self._expected[self._span[row]]:
                next(self._each_piece(name, row, lambda *_: None))  # raises, naming the sample
            return block[int(starts[i]) + start:int(starts[i]) + stop]
        if stop <= start:
            return read_only(torch.empty((0, self.widths[name]), dtype=self.dtypes))

        def rows_of(chunk, i, n, at):  # the requested rows this piece holds, decoded alone
            lo, hi = max(start, at), min(stop, at + n)
            return (lo, cells.sample_rows(chunk, i, lo - at, hi - at)) if lo < hi else None

        out = None
        for got in self._each_piece(name, row, rows_of, within=(start, stop)):
            if got is None:
                continue
            lo, rows = got
            if lo == start and rows.shape[0] == stop - start:  # one piece holds them all
                # the rows layout's view would keep the row group's Arrow buffer alive, unless the shard keeps it
                kept = g is not None and (name, g) in self._chunks
                view = type(cells) is fmt.Cells and not cells.planes
                return rows if kept or not view else read_only(rows.clone())
            if out is None:
                out = torch.empty((stop - start, self.widths[name]), dtype=self.dtypes)
            with torch._C.DisableTorchFunctionSubclass():
                out[lo - start:lo - start + rows.shape[0]] = rows
            got = rows = None
        return read_only(out)

    def num_rows(self, row: int) -> int:
        name = next(iter(self.widths), None)
        if name is None:
            return 0
        if self._expected is not None:
            return int(self._expected[self._span[row]:self._span[row + 1]].sum())
        g = self._whole_sample(row)  # before format 4: no pieces, each sample's cells say
        block, starts = self.block(name, g)
        i = int(self._span[row]) - int(self._group_start[g])
        return int(starts[i + 1] - starts[i])


def own(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor that is the whole of its storage (what ``torch.save`` and safetensors write,
    and what keeps no other rows alive): ``t`` itself, sharing its memory, where it already is (a long
    sample's decoded rows), else a copy (a view into a row group's block or an Arrow buffer)."""
    with torch._C.DisableTorchFunctionSubclass():
        plain = t.as_subclass(torch.Tensor)
        whole = plain.is_contiguous() and plain.storage_offset() == 0 and \
            plain.untyped_storage().nbytes() == plain.numel() * plain.element_size()
        return plain if whole else plain.clone()


def _checksum(source: pa.NativeFile, chunk: int = 1 << 20) -> str:
    """:func:`~hsx.shards.manifest.streamed_checksum` of an open file, read through one small buffer: the
    file is never held (or mapped) whole, and what is checked is what the shard then reads from."""
    h = xxhash.xxh3_128()
    block = bytearray(chunk)
    view = memoryview(block)
    source.seek(0)
    while n := source.readinto(view):
        h.update(view[:n])
    return h.hexdigest()


def load_shard(path: Path, entry: ShardEntry | None, cache_blocks: int | None = None, *, whole: bool = True) -> _Shard:
    """Open and check one shard file; any fault raises :class:`ShardError` naming the file.

    Size and checksum (against the manifest entry), footer, schema and metadata are checked here, and
    every column but the hidden ones is read. ``whole``: the hidden columns too, into ``shard.table``
    (``hsx verify``); else each hidden row group is read, and checked, when a reader asks for it.
    """
    try:
        source = open_input(path, pa.OSFile)  # a local file, or an object in a store (hsx.shards.store)
    except FileNotFoundError:
        raise ShardError(f"{path}: shard listed in the manifest is missing") from None
    if entry is not None:
        size = source.size()
        if size != entry.bytes:
            raise ShardError(f"{path}: {size} bytes on disk, manifest says {entry.bytes} (truncated or rewritten)")
        digest = _checksum(source)
        if digest != entry.xxh3_128:
            raise ShardError(f"{path}: checksum {digest} does not match the manifest's {entry.xxh3_128} (corrupt)")
    try:
        # Page CRCs are checked only without a manifest entry: once the whole file's xxh3-128
        # matches, they cannot fail, and verifying them would halve the read speed.
        parquet = pq.ParquetFile(source, page_checksum_verification=entry is None)
        schema = parquet.schema_arrow
    except _READ_ERRORS as e:
        raise ShardError(f"{path}: unreadable Parquet ({e})") from None
    meta = fmt.read_metadata(schema, str(path))
    check_schema(schema, meta, str(path))
    hidden = {g["name"] for g in meta["layers"]}
    try:
        raw = parquet.read(columns=[n for n in schema.names if n not in hidden], use_threads=True)
    except _READ_ERRORS as e:
        raise ShardError(f"{path}: unreadable Parquet ({e})") from None
    table = fmt.join_pieces(raw, meta, str(path))  # from here on a row is a sample
    if entry is not None:
        if table.num_rows != entry.samples:
            raise ShardError(f"{path}: {table.num_rows} samples, manifest says {entry.samples}")
        if table.column("sample_id").to_pylist() != entry.sample_ids:
            raise ShardError(f"{path}: sample ids differ from the manifest's list")
        if entry.source_indices is not None and table.column("source_index").to_pylist() != entry.source_indices:
            raise ShardError(f"{path}: source indices differ from the manifest's list")
    shard = _Shard(path, source, parquet, raw, table, meta, cache_blocks, page_checksums=entry is None)
    if whole:
        shard.table  # noqa: B018 - read and checked here, so that a fault is the load's
    elif entry is None:
        shard.check_hidden()  # no whole-file checksum to lean on: every page's CRC and every cell, now
    return shard


def check_schema(schema: pa.Schema, meta: dict, where: str) -> None:
    expected = fmt.schema_for(meta)
    try:
        names = set(schema.names)
    except UnicodeDecodeError:
        raise ShardError(f"{where}: column names in the Parquet footer are not valid UTF-8 (corrupt footer)") from None
    for f in expected:
        at = schema.get_all_field_indices(f.name) if f.name in names else []
        if not at:
            raise ShardError(f"{where}: column {f.name!r} is missing")
        if len(at) > 1:
            raise ShardError(f"{where}: column {f.name!r} appears {len(at)} times (corrupt footer)")
        got = schema.field(at[0])
        if not got.type.equals(f.type):
            raise ShardError(f"{where}: column {f.name!r} has type {got.type}, expected {f.type}")


class Sample:
    """One sequence. Hidden states: ``s.hidden(name)`` -> read-only ``[rows, W]`` view; row j is the state
    at token position ``s.positions[j]`` (position j, every one the mode covers, unless the run used ``--keep``)."""

    __slots__ = ("_shard", "_row", "index")

    def __init__(self, shard: _Shard, row: int, index: int):
        self._shard, self._row, self.index = shard, row, index

    sample_id = property(lambda self: self._shard.scalar("sample_id", self._row))
    source_index = property(lambda self: self._shard.scalar("source_index", self._row))
    prompt_len = property(lambda self: self._shard.scalar("prompt_len", self._row))
    finish_reason = property(lambda self: self._shard.scalar("finish_reason", self._row))
    verify_steps = property(lambda self: self._shard.scalar("verify_steps", self._row))
    input_ids = property(lambda self: self._shard.int_list("input_ids", self._row))  # [N] int32
    loss_mask = property(lambda self: self._shard.int_list("loss_mask", self._row))  # [N] uint8
    accept_lens = property(lambda self: self._shard.int_list("accept_lens", self._row))  # [steps] int16 or None

    @property
    def num_rows(self) -> int:
        return self._shard.num_rows(self._row)

    @property
    def positions(self) -> torch.Tensor:
        """Token position of each row, in row order (every covered position unless the run used ``--keep``)."""
        meta = self._shard.metadata
        pos = positions.sample_positions(fmt.keep_of(meta), meta["mode"], len(self.input_ids), self.prompt_len,
                                         self.loss_mask.numpy())
        return torch.from_numpy(pos)

    @property
    def hidden(self) -> "SampleColumns":
        """This sample's hidden columns, by call or by key: ``s.hidden("final")`` or ``s.hidden["final"]``
        (as an ``hsx.stream`` record spells it).

        Each is ``[rows, W]`` in the shards' dtype (``metadata["dtype"]``:
        bfloat16, float16 or float32), W the column's width (a column of several sources, such as
        ``eagle3``, holds them side by side in the order its ``metadata["layers"]`` entry lists).

        A read-only tensor in the shard's memory (a view of its row group's block; a long sample's rows are
        decoded piece by piece into one tensor of their own): writing to it raises; ``.clone()`` (or
        ``.float()``) to modify. Row j is the state after consuming token ``positions[j]`` (it predicts
        token ``positions[j] + 1``): without ``--keep``, position j, ``N - 1`` rows in generate mode and
        ``N`` in prefill mode for N tokens; under ``--keep`` only the positions its rule keeps, in order.
        ``s.hidden("final", rows=slice(a, b))`` reads rows a..b-1 alone, without decoding the rest, and
        ``s.hidden.pieces("final")`` gives the rows a stored piece at a time.
        """
        return SampleColumns(self)

    def __repr__(self) -> str:
        return f"Sample({self.sample_id!r}, tokens={len(self.input_ids)}, rows={self.num_rows})"


class SampleColumns:
    """The hidden columns of one :class:`Sample`, read when asked for, by call or by key."""

    def __init__(self, sample: Sample):
        self._sample = sample

    def keys(self) -> list[str]:
        return [g["name"] for g in self._sample._shard.metadata["layers"]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self(name)

    def __call__(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Column ``name`` of the sample (see :attr:`Sample.hidden`); ``rows=slice(a, b)`` reads rows a..b-1
        alone, without decoding the rest of the sample (a long sample's other pieces included)."""
        shard, row = self._sample._shard, self._sample._row
        if rows is None:
            return shard.hidden(name, row)
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"rows must be a slice of consecutive rows (slice(a, b)), got {rows!r}")
        start, stop, _ = rows.indices(shard.num_rows(row))
        return shard.hidden_rows(name, row, start, max(start, stop))

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        """Column ``name`` of the sample as consecutive read-only ``[rows_i, W]`` tensors, one stored piece
        at a time (docs/FORMAT.md, "Long samples"): ``torch.cat`` of them is ``s.hidden(name)``. A sample
        stored whole comes as one tensor; a long one never has more than one piece decoded at once, so a
        consumer that writes each piece out before taking the next holds about one piece."""
        return self._sample._shard.hidden_pieces(name, self._sample._row)


@dataclass
class RowLabels:
    """What each row of a block of samples is: ``owner`` (sample within the block), position, tokens."""

    owner: np.ndarray  # [R] int64
    position: np.ndarray  # [R] int64
    token_id: np.ndarray  # [R] int64, the row's input token
    next_token: np.ndarray  # [R] int64, the token the row predicts; -1 after the last token
    chosen: np.ndarray  # [R] bool, the rows the ``where`` rule selects (all of them for "all")


def row_labels(meta: dict, input_ids: pa.ListArray, prompt_len: pa.Array, loss_mask: pa.ListArray,
               rows: np.ndarray, where: str, rule: str = "all", first_row: np.ndarray | None = None) -> RowLabels:
    """Labels of the stored rows of a block of samples (one Arrow chunk per column), in ``where``.

    ``rows`` [S] are the block's stored row counts; they must match what the shard's ``keep`` rule
    gives for these tokens, else the rows would be labelled with the wrong positions. ``rule``
    (a :mod:`hsx.shards.positions` rule) marks the rows a reader wants in ``chosen``. A block of
    pieces (format 6, read without joining) gives each piece's ``first_row``: its rows are then the
    sample's rows ``first_row .. first_row + rows - 1``, and ``owner`` numbers the pieces.
    """
    ids_off = input_ids.offsets.to_numpy().astype(np.int64)
    ids = input_ids.values.to_numpy().astype(np.int64)[ids_off[0]:]
    ids_off = ids_off - ids_off[0]
    n_tok = np.diff(ids_off)
    mask_off = loss_mask.offsets.to_numpy()
    if not np.array_equal(np.diff(mask_off), n_tok):
        raise ShardError(f"{where}: loss_mask lengths differ from the token counts of their samples")
    mask = loss_mask.values.to_numpy()[mask_off[0]:mask_off[-1]]
    prompt = prompt_len.to_numpy().astype(np.int64)
    owner, pos = positions.kept(fmt.keep_of(meta), meta["mode"], n_tok, prompt, mask, ids_off)
    want = np.bincount(owner, minlength=len(n_tok))
    if first_row is not None and np.any((first_row > 0) | (rows < want)):  # pieces: each must lie inside its sample
        first_row = np.asarray(first_row, np.int64)
        if np.any(first_row + rows > want):
            j = int(np.flatnonzero(first_row + rows > want)[0])
            raise ShardError(f"{where}: a piece of sample {j} of a row group holds rows {int(first_row[j])}.."
                             f"{int(first_row[j] + rows[j]) - 1}; keep={fmt.keep_of(meta)!r} in {meta['mode']} mode gives "
                             f"{int(want[j])} for its {int(n_tok[j])} tokens")
        rank = np.arange(len(owner)) - (np.cumsum(want) - want)[owner]  # row index within its sample
        inside = (rank >= first_row[owner]) & (rank < (first_row + rows)[owner])
        owner, pos, want = owner[inside], pos[inside], rows
    if not np.array_equal(want, rows):
        j = int(np.flatnonzero(want != rows)[0])
        raise ShardError(f"{where}: sample {j} of a row group has {int(rows[j])} rows; keep={fmt.keep_of(meta)!r} "
                         f"in {meta['mode']} mode gives {int(want[j])} for its {int(n_tok[j])} tokens")
    at = ids_off[owner] + pos
    has_next = pos + 1 < n_tok[owner]
    nxt = np.where(has_next, ids[np.minimum(at + 1, max(len(ids) - 1, 0))] if len(ids) else 0, -1)
    chosen = positions.select(rule, meta["mode"], owner, pos, n_tok, prompt, mask, ids_off)
    return RowLabels(owner, pos, ids[at], nxt, chosen)


@dataclass
class TokenMatrix:
    """Every row of one column: ``hidden[r]`` belongs to sample ``sample_index[r]`` at ``position[r]``."""

    hidden: torch.Tensor  # [R, W]
    sample_index: torch.Tensor  # [R] int64, index into the dataset
    position: torch.Tensor  # [R] int64
    token_id: torch.Tensor  # [R] int64, the token at that position (the row's input)


class ShardDataset:
    """Samples of a directory of shards (or one shard file): in source order where the manifest lists
    source indices (format 3), else in manifest order."""

    def __init__(self, paths: list[Path], entries: list[ShardEntry | None], counts: list[int], metadata: dict,
                 errors: list[ErrorRecord] = (), cache_shards: int = 4, index: np.ndarray | None = None,
                 cache_blocks: int | None = None):
        self._paths, self._entries, self._counts = paths, entries, counts
        self._cache_blocks = cache_blocks
        self.metadata = metadata
        self.errors = list(errors)
        self._cache: OrderedDict[int, _Shard] = OrderedDict()
        self._cache_shards = max(1, cache_shards)
        starts = np.cumsum([0, *counts])
        self._starts = starts
        # global sample i -> (shard k, row): kept as one array of flat indices into the shards
        self._index = np.arange(starts[-1]) if index is None else index
        self._by_id: dict[str, int] | None = None  # sample id -> index, built on the first lookup by id

    @property
    def columns(self) -> list[str]:
        return [g["name"] for g in self.metadata["layers"]]

    def __getstate__(self) -> dict:
        # open shards hold a file and what was read from it: a copy (a DataLoader worker started by spawn)
        # opens them again when it needs them
        return {**self.__dict__, "_cache": OrderedDict()}

    def __len__(self) -> int:
        return len(self._index)

    def _shard(self, k: int) -> _Shard:
        shard = self._cache.get(k)
        if shard is None:
            shard = load_shard(self._paths[k], self._entries[k], self._cache_blocks, whole=False)
            self._cache[k] = shard
            while len(self._cache) > self._cache_shards:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(k)
        return shard

    def _locate(self, flat: int) -> tuple[int, int]:
        k = int(np.searchsorted(self._starts, flat, side="right")) - 1
        return k, flat - int(self._starts[k])

    def __getitem__(self, i: int | str) -> Sample:
        """Sample ``i`` in dataset order (negative from the end), or the sample whose id is ``i``."""
        if isinstance(i, str):
            return self[self._index_of(i)]
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        i = i % len(self)
        k, row = self._locate(int(self._index[i]))
        return Sample(self._shard(k), row, i)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def _index_of(self, sample_id: str) -> int:
        if self._by_id is None:
            self._by_id = {sid: j for j, sid in enumerate(self.sample_ids)}
        if sample_id not in self._by_id:
            raise KeyError(f"sample id {sample_id!r} is not in this dataset ({len(self)} samples)")
        return self._by_id[sample_id]

    @property
    def sample_ids(self) -> list[str]:
        ids = self._all_ids()
        return [ids[j] for j in self._index]

    def _all_ids(self) -> list[str]:
        if all(e is not None for e in self._entries):
            return [i for e in self._entries for i in e.sample_ids]
        return [i for k in range(len(self._paths)) for i in self._shard(k).meta.column("sample_id").to_pylist()]

    def select(self, sample_ids: Iterable[str]) -> "ShardDataset":
        """A view of the samples with these ids, in the order given."""
        where = {sid: j for j, sid in enumerate(self._all_ids())}
        picked = []
        for sid in sample_ids:
            if sid not in where:
                raise KeyError(f"sample id {sid!r} is not in this dataset")
            picked.append(where[sid])
        return ShardDataset(self._paths, self._entries, self._counts, self.metadata, self.errors,
                            self._cache_shards, np.asarray(picked, dtype=np.int64), self._cache_blocks)

    def model_path(self) -> Path | None:
        """The run's model directory, where it is on this machine (see :func:`local_dir`), else None."""
        return local_dir(self.metadata.get("model") or {}, self._near())

    def tokenizer(self):
        """The run's tokenizer (``transformers.AutoTokenizer``), from the tokenizer or model directory the
        metadata names (see :func:`local_dir`); :class:`HsxError` naming what was tried when neither is here."""
        for key in ("tokenizer", "model"):
            path = local_dir(self.metadata.get(key) or {}, self._near())
            if path is not None:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(str(path))
        tried = sorted({str(v) for key in ("tokenizer", "model") for name in ("resolved_path", "path")
                        if (v := (self.metadata.get(key) or {}).get(name))})
        raise HsxError(f"the run's tokenizer is not on this machine (tried {tried or 'nothing: the metadata names no path'} "
                       "from here and from the folders above the shards); load it yourself with "
                       "transformers.AutoTokenizer.from_pretrained(PATH)")

    def _near(self) -> Path | None:
        return self._paths[0].resolve().parent if self._paths else None

    def table(self, columns: Sequence[str] | None = None) -> pa.Table:
        """Metadata columns of every sample (no hidden states) as one Arrow table, in dataset order."""
        cols = list(columns or fmt.BASE_NAMES)
        parts = [self._shard(k).whole_table(cols) for k in range(len(self._paths))]  # hidden ones read if asked for
        whole = pa.concat_tables(parts) if parts else fmt.schema_for(self.metadata).empty_table().select(cols)
        in_order = np.array_equal(self._index, np.arange(whole.num_rows))
        return whole if in_order else whole.take(pa.array(self._index))  # a select() view picks and reorders

    def tokens(self, name: str, shard: int | None = None) -> TokenMatrix:
        """All rows of column ``name`` (one shard, or every shard) with their sample and position, in dataset
        order: samples as ``ds[i]`` numbers them, each one's rows in position order.

        The matrix is allocated once and each row group is decoded straight into its rows (memory: the
        matrix and one row group or piece being read); one row group in order is its block, a view."""
        if name not in self.columns:
            raise KeyError(f"no hidden-state column {name!r}; columns: {self.columns}")
        shards = range(len(self._paths)) if shard is None else [shard]
        width = next(g["width"] for g in self.metadata["layers"] if g["name"] == name)
        dtype = fmt.dtype_of(self.metadata["dtype"])
        owner, pos, tok, plan = [], [], [], []
        global_of = np.full(self._starts[-1], -1, dtype=np.int64)
        global_of[self._index] = np.arange(len(self._index))
        at = 0
        for k in shards:
            s = self._shard(k)
            ids, prompt, mask = (s.meta.column(c).combine_chunks() for c in ("input_ids", "prompt_len", "loss_mask"))
            prow = _parquet_row_rows(s, ids, prompt, mask)  # rows each Parquet row holds
            rows = np.add.reduceat(prow, s._span[:-1]) if len(prow) else np.zeros(0, np.int64)  # per sample
            labels = row_labels(s.metadata, ids, prompt, mask, rows, str(s.path))
            owner.append(global_of[labels.owner + int(self._starts[k])])
            pos.append(labels.position)
            tok.append(labels.token_id)
            plan.append((s, prow, rows, at))
            at += int(rows.sum())
        cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, dtype=np.int64)
        sample_index, position, token_id = cat(owner), cat(pos), cat(tok)
        # rows in dataset order; samples outside a select() view (index -1) are dropped
        order = np.flatnonzero(sample_index >= 0)
        order = order[np.argsort(sample_index[order], kind="stable")]
        in_place = len(order) == len(sample_index) and bool(np.all(order == np.arange(len(order))))
        groups = [(s, g) for s, *_ in plan for g in range(len(s._group_start) - 1)
                  if s._group_start[g + 1] > s._group_start[g]]
        if len(groups) == 1 and in_place and groups[0][0]._whole_group[groups[0][1]]:
            (s, g), prow = groups[0], plan[0][1]
            h, starts = s.block(name, g)  # one row group in order: its block (a view for rows)
            _check_rows(s, name, np.diff(starts), prow, 0)
        else:  # allocated once; each row group decoded straight into its samples' rows, then let go
            h = torch.empty((len(order), width), dtype=dtype)
            inv = None if in_place else np.full(len(sample_index), -1, np.int64)
            if inv is not None:
                inv[order] = np.arange(len(order))
            for s, prow, rows, base in plan:
                _fill(s, name, h, prow, rows, base, inv)
        as_torch = lambda a: torch.from_numpy(a if in_place else a[order])
        # the same contract whether h is a view or a copy: read-only, clone to modify
        return TokenMatrix(read_only(h), as_torch(sample_index), as_torch(position), as_torch(token_id))

    def __repr__(self) -> str:
        return f"ShardDataset({len(self)} samples, {len(self._paths)} shards, columns={self.columns})"


def _parquet_row_rows(s: _Shard, ids: pa.ListArray, prompt: pa.Array, mask: pa.ListArray) -> np.ndarray:
    """Rows each Parquet row of a shard holds: its positions column's (format 4 on), else what the keep
    rule gives its sample (one Parquet row a sample before format 6)."""
    if s._expected is not None:
        return s._expected
    n_tok = np.diff(ids.offsets.to_numpy()).astype(np.int64)
    offs = ids.offsets.to_numpy().astype(np.int64)
    return positions.stored_rows(fmt.keep_of(s.metadata), s.metadata["mode"], n_tok, prompt.to_numpy().astype(np.int64),
                                 mask.values.to_numpy()[mask.offsets.to_numpy()[0]:], offs - offs[0])


def _check_rows(s: _Shard, name: str, got: np.ndarray, want: np.ndarray, first: int) -> None:
    """The cells of Parquet rows ``first ..`` of a shard hold the rows their positions (or the keep rule) give."""
    bad = np.flatnonzero(got != want)
    if len(bad):
        p = first + int(bad[0])
        sample = int(np.searchsorted(s._span, p, side="right")) - 1
        raise ShardError(f"{s.path}: sample {s.scalar('sample_id', sample)!r} has {int(got[bad[0]])} rows of {name!r} "
                         f"in a Parquet row where keep={fmt.keep_of(s.metadata)!r} in {s.metadata['mode']} mode gives "
                         f"{int(want[bad[0]])}")


def _fill(s: _Shard, name: str, out: torch.Tensor, prow: np.ndarray, rows: np.ndarray, base: int,
          inv: np.ndarray | None) -> None:
    """Write shard ``s``'s rows of ``name`` into ``out``: sample j's rows go to ``base + (rows before j)``, or
    where ``inv`` (concatenated row -> row of ``out``, -1 dropped) sends them; one row group read at a time."""
    if not len(prow):
        return
    first = base + np.cumsum(rows) - rows  # each sample's first row, concatenated
    dest = first if inv is None else np.where(rows > 0, inv[np.minimum(first, len(inv) - 1)] if len(inv) else -1, -1)
    owner = np.repeat(np.arange(len(rows)), np.diff(s._span))  # Parquet row -> its sample
    before = np.cumsum(prow) - prow
    to = dest[owner] + before - before[s._span[owner]]  # each Parquet row's first row in out
    cells = s.cells[name]
    for g in range(len(s._group_start) - 1):
        a, b = int(s._group_start[g]), int(s._group_start[g + 1])
        wanted = np.flatnonzero((dest[owner[a:b]] >= 0) & (prow[a:b] > 0))
        if not len(wanted):
            continue
        if (name, g) in s._blocks:
            block, starts = s.block(name, g)
            got = np.diff(starts)
        else:
            block = None
            chunk, got = s._chunks.get((name, g)) or s._read(name, g)
        _check_rows(s, name, got, prow[a:b], a)
        run = None  # consecutive Parquet rows whose rows follow each other in out: one decode
        for i in [*wanted.tolist(), None]:
            if run is not None and i is not None and i == run[1] and to[a + i] == run[2]:
                run = (run[0], i + 1, run[2] + int(prow[a + i]))
                continue
            if run is not None:
                i0, i1, end = run
                start = int(to[a + i0])
                if block is not None:
                    with torch._C.DisableTorchFunctionSubclass():
                        out[start:end] = block[int(starts[i0]):int(starts[i1])]
                else:
                    cells.decode_into(chunk.slice(i0, i1 - i0), out[start:end])
            if i is not None:
                run = (i, i + 1, int(to[a + i]) + int(prow[a + i]))
        del block
        chunk = None


def local_dir(recorded: dict, near: Path | None = None) -> Path | None:
    """The directory a metadata entry (``model`` or ``tokenizer``) names, where it exists here.

    ``resolved_path`` (the absolute path the run resolved) first, then ``path`` as the user gave it:
    absolute, or relative to the current directory or to any folder above ``near`` (the shards). None
    when neither is a directory here (a hub id, another machine's path)."""
    roots = [Path.cwd()] + (list(near.parents) if near is not None else [])
    for key in ("resolved_path", "path"):
        given = recorded.get(key)
        if not given:
            continue
        for root in roots:
            path = root / Path(given).expanduser()  # an absolute path ignores root
            if path.is_dir():
                return path
    return None


def _source_order(entries: list[ShardEntry]) -> np.ndarray | None:
    """Samples in source (dataset) order, whatever order the engine finished and the shards were
    committed in; None (manifest order) for a manifest that does not list source indices."""
    if not entries or any(e.source_indices is None for e in entries):
        return None
    return np.argsort(np.concatenate([np.asarray(e.source_indices, dtype=np.int64) for e in entries]), kind="stable")


def open_shards(path: str | Path, cache_shards: int = 4, cache_blocks: int | None = None) -> ShardDataset:
    """Open an hsx output directory (through its manifest) or a single shard file.

    ``cache_shards`` shards stay open (their small columns in memory); each keeps the row groups of whole
    samples it has decoded, at most ``cache_blocks`` of each column (and as many read for partial reads;
    None: all of them). A reader that goes through the samples once, like the exports, needs one or two."""
    path = as_path(path)  # a local path, or s3://bucket/prefix
    if path.is_dir():
        m = load_manifest(path)
        paths = [shard_path(path, s.file) for s in m.shards]
        return ShardDataset(paths, list(m.shards), [s.samples for s in m.shards], m.metadata, m.errors, cache_shards,
                            _source_order(m.shards), cache_blocks)
    if not path.exists():
        raise ShardError(f"{path}: no such file or directory")
    entry = None
    if manifest_path(path.parent).exists():
        m = load_manifest(path.parent)
        entry = next((s for s in m.shards if shard_path(path.parent, s.file) == path), None)
        if entry is None:
            raise ShardError(f"{path}: not listed in {manifest_path(path.parent)} (an uncommitted or stray file)")
    shard = load_shard(path, entry, cache_blocks, whole=False)
    ds = ShardDataset([path], [entry], [shard.meta.num_rows], shard.metadata, (), cache_shards, None, cache_blocks)
    ds._cache[0] = shard
    return ds
