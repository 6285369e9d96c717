"""One shard file, opened and checked: :func:`load_shard` -> :class:`Shard`.

The checks come before any number leaves the file: size and xxh3-128 checksum against the manifest
(Parquet page CRCs for a file opened without one), footer, schema and metadata. A shard holds its
small columns (one row per sample, a long sample's pieces joined); its hidden columns are read from
the file one row group of one column at a time, when asked for, and each row group's cells are
checked as it is read. A row group of whole samples is decoded once and kept; a long sample's pieces
(format 6) are decoded one at a time straight into one tensor, and a range of rows reads only the
pieces that hold it. :mod:`hsx.shards.reader` builds samples and datasets on top.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import xxhash

from hsx.errors import ShardError
from hsx.shards import format as fmt
from hsx.shards import positions
from hsx.shards.cells import Cells
from hsx.shards.manifest import ShardEntry
from hsx.shards.readonly import read_only
from hsx.storage.store import open_input

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


class Shard:
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
        self.cells = {g["name"]: Cells.of(metadata, g) for g in metadata["layers"]}
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

    @property
    def sample_spans(self) -> np.ndarray:
        """[samples + 1]: each sample's first Parquet row (a long sample spans several), the rows' count last."""
        return self._span

    @property
    def listed_rows(self) -> np.ndarray | None:
        """[Parquet rows]: the rows each Parquet row's positions column lists (None before format 4)."""
        return self._expected

    def groups(self, name: str) -> Iterator[tuple[int, np.ndarray, torch.Tensor]]:
        """Every row group of hidden column ``name`` in order, read, checked and decoded one at a time and
        kept by nobody (``hsx verify``): (its first Parquet row, the rows each of its Parquet rows holds,
        its rows as one ``[R, W]`` tensor)."""
        self._check_name(name)
        for g in range(len(self._group_start) - 1):
            first = int(self._group_start[g])
            chunk, rows = self._read(name, g)
            block = self.cells[name].block(chunk)
            chunk = None
            yield first, rows, block
            block = None
            pa.default_memory_pool().release_unused()

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
            view = type(cells) is Cells and not cells.planes  # the block is a view of the chunk: keep it named
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
                view = type(cells) is Cells and not cells.planes
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


def checksum(source: pa.NativeFile, chunk: int = 1 << 20) -> str:
    """:func:`~hsx.shards.manifest.streamed_checksum` of an open file, read through one small buffer: the
    file is never held (or mapped) whole, and what is checked is what the shard then reads from."""
    h = xxhash.xxh3_128()
    block = bytearray(chunk)
    view = memoryview(block)
    source.seek(0)
    while n := source.readinto(view):
        h.update(view[:n])
    return h.hexdigest()


class ShardMissing(ShardError):
    """A shard file that is not where it was looked for."""


def load_shard(path: Path, entry: ShardEntry | None, cache_blocks: int | None = None, *,
               check_hidden: bool = True) -> Shard:
    """Open and check one shard file; any fault raises :class:`ShardError` naming the file.

    Size and checksum (against the manifest entry), footer, schema and metadata are checked here, and
    every column but the hidden ones is read; each hidden row group is read, and checked, when a reader
    asks for it. Without a manifest entry (no checksum to lean on) every hidden row group is read and
    checked now, unless ``check_hidden`` is False: a caller that reads them all itself (``hsx verify``).
    """
    try:
        source = open_input(path, pa.OSFile)  # a local file, or an object in a store (hsx.storage.store)
    except FileNotFoundError:
        raise ShardMissing(f"{path}: shard listed in the manifest is missing") from None
    if entry is not None:
        size = source.size()
        if size != entry.bytes:
            raise ShardError(f"{path}: {size} bytes on disk, manifest says {entry.bytes} (truncated or rewritten)")
        digest = checksum(source)
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
        raw = parquet.read(columns=[n for n in schema.names if n not in hidden], use_threads=False)
    except _READ_ERRORS as e:
        raise ShardError(f"{path}: unreadable Parquet ({e})") from None
    table = fmt.join_pieces(raw, meta, str(path))  # from here on a row is a sample
    if entry is not None:
        if table.num_rows != entry.samples:
            raise ShardError(f"{path}: {table.num_rows} samples, manifest says {entry.samples}")
        if entry.sample_ids != table.column("sample_id").to_pylist():
            raise ShardError(f"{path}: sample ids differ from the manifest's list")
        if entry.source_indices is not None and \
                not np.array_equal(table.column("source_index").to_numpy(), entry.source_indices.array):
            raise ShardError(f"{path}: source indices differ from the manifest's list")
    shard = Shard(path, source, parquet, raw, table, meta, cache_blocks, page_checksums=entry is None)
    if entry is None and check_hidden:
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


def parquet_row_rows(s: Shard, ids: pa.ListArray, prompt: pa.Array, mask: pa.ListArray) -> np.ndarray:
    """Rows each Parquet row of a shard holds: its positions column's (format 4 on), else what the keep
    rule gives its sample (one Parquet row a sample before format 6)."""
    if s._expected is not None:
        return s._expected
    n_tok = np.diff(ids.offsets.to_numpy()).astype(np.int64)
    offs = ids.offsets.to_numpy().astype(np.int64)
    return positions.stored_rows(fmt.keep_of(s.metadata), s.metadata["mode"], n_tok, prompt.to_numpy().astype(np.int64),
                                 mask.values.to_numpy()[mask.offsets.to_numpy()[0]:], offs - offs[0])


def check_rows(s: Shard, name: str, got: np.ndarray, want: np.ndarray, first: int) -> None:
    """The cells of Parquet rows ``first ..`` of a shard hold the rows their positions (or the keep rule) give."""
    bad = np.flatnonzero(got != want)
    if len(bad):
        p = first + int(bad[0])
        sample = int(np.searchsorted(s._span, p, side="right")) - 1
        raise ShardError(f"{s.path}: sample {s.scalar('sample_id', sample)!r} has {int(got[bad[0]])} rows of {name!r} "
                         f"in a Parquet row where keep={fmt.keep_of(s.metadata)!r} in {s.metadata['mode']} mode gives "
                         f"{int(want[bad[0]])}")


def fill(s: Shard, name: str, out: torch.Tensor, prow: np.ndarray, rows: np.ndarray, base: int,
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
        check_rows(s, name, got, prow[a:b], a)
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
