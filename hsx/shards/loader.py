"""A streaming loader of token rows for probes and SAEs: ``hsx.tokens_loader(path, ...)``.

A torch ``IterableDataset`` that yields batches of hidden rows (one or several columns) with their
labels, reading one row group at a time (a few samples of it at a time; a long sample's piece one
column at a time), so memory stays bounded by the shuffle buffer and a few row groups' worth of
rows whatever the size of the dataset or of a sample (``ds.tokens()`` holds everything instead).
Batches are memory of their own: keeping one keeps only its rows.

- Work units are (shard, row group) blocks, visited in a seeded order that changes with
  :meth:`TokenLoader.set_epoch`; unit u goes to consumer ``u % (world_size * num_workers)``, so
  every DataLoader worker of every rank reads different rows and each row comes out once per
  epoch. With fewer blocks than consumers, each block is cut into equal slices of its rows.
- A seeded shuffle buffer (``shuffle_buffer`` rows) mixes rows across blocks and sequences: once
  it is full, each incoming batch of rows replaces as many randomly chosen buffered rows, which
  are emitted. ``shuffle_buffer=0`` keeps storage order.
- ``where`` picks rows by the position rules of :mod:`hsx.shards.positions` (all, completion,
  loss, last) among the rows the shards store; on a vision-language output also by the row's own
  token (``image``, ``text``), alone or after a position rule (``loss,text``).
- From an object store (``s3://``) each block's footer and column chunks are fetched by ranged
  reads, never a whole shard; its size is checked against the manifest and its pages' CRCs as they
  are read (the whole-file checksum would mean fetching it all). ``read_ahead`` (default 2) batches
  of rows are read on a thread of their own ahead of the consumer, so that the store's round trips
  overlap decoding and training; it costs that many batches of rows in memory. Local shards are
  read on the consumer's thread.

Batches are dicts: each column ``[B, W]`` in the stored dtype, ``token_id`` (the row's input
token), ``next_token`` (the token it predicts, -1 after the last), ``position`` and
``sample_index`` (index into ``hsx.open(path)``; ``loader.sample_ids[i]`` is its id), all int64.
Use it with ``DataLoader(loader, batch_size=None, num_workers=...)``: it batches itself.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import IterableDataset, get_worker_info

from hsx.errors import HsxError, ShardError
from hsx.shards import format as fmt
from hsx.shards import positions
from hsx.shards.cells import Cells, check_row_bytes, column_rows
from hsx.shards.manifest import ShardEntry
from hsx.shards.reader import ShardPaths, open_shards, row_labels
from hsx.shards.shard import ShardMissing, check_schema, checksum
from hsx.storage.store import is_remote, open_ranged

LABELS = ("token_id", "next_token", "position", "sample_index")
SAMPLES_PER_READ = 16  # samples decoded at a time: memory is this many samples, not a whole row group
LAYOUT_THREADS = 16  # shards whose footers are read at once from a store when a loader starts
_BASE = ["input_ids", "prompt_len", "loss_mask"]


@dataclass(frozen=True)
class _Block:
    shard: int
    row_group: int
    first_sample: int  # global index of its first sample
    part: int  # which slice of the block's rows (of ``parts``)
    parts: int


class TokenLoader(IterableDataset):
    """Every selected token row of ``columns`` across all shards, in shuffled batches (module docstring)."""

    def __init__(self, path: str | Path, columns: Sequence[str] | None = None, where: str = "all",
                 batch_size: int = 1024, shuffle_buffer: int = 1 << 16, seed: int = 0, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, read_ahead: int = 2):
        ds = open_shards(path)
        self.metadata = ds.metadata
        self.columns = list(columns) if columns is not None else ds.columns
        unknown = [c for c in self.columns if c not in ds.columns]
        if not self.columns:
            raise HsxError(f"{path}: no hidden-state column to load; columns: {ds.columns}")
        if unknown:
            raise HsxError(f"{path}: no hidden-state column(s) {unknown}; columns: {ds.columns}")
        self.where = positions.check_where(where, ds.metadata["mode"], bool(ds.metadata.get("vision")))
        # a token rule (image, text) reads each sample's image_mask beside its ids and masks
        self._base = _BASE + ([fmt.IMAGE_MASK.name] if positions.split_where(self.where)[1] else [])
        if batch_size < 1 or shuffle_buffer < 0:
            raise HsxError(f"batch_size must be >= 1 and shuffle_buffer >= 0; got {batch_size}, {shuffle_buffer}")
        self.batch_size, self.shuffle_buffer, self.seed, self.drop_last = batch_size, shuffle_buffer, seed, drop_last
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        if read_ahead < 0:
            raise HsxError(f"read_ahead must be >= 0, got {read_ahead}")
        self.read_ahead = int(read_ahead)
        self.epoch = 0
        self._ds, self._sample_ids = ds, None  # the ids listed when first asked for (sample_ids)
        # a sample's place in the shards -> its index in hsx.open(path) (source order, format 3)
        self._dataset_index = np.empty(len(ds._index), dtype=np.int64)
        self._dataset_index[ds._index] = np.arange(len(ds._index))
        self._entries = list(ds._entries)
        self._layers = [g for g in ds.metadata["layers"] if g["name"] in self.columns]
        # each shard's file and the samples starting in each of its row groups
        self._paths, self._groups = _layouts(ds._paths)
        self._starts = [int(x) for x in ds._starts]

    @property
    def sample_ids(self) -> list[str]:
        """The id of each ``sample_index``: listed when first asked for (a Python list of every id is
        ~70 bytes a sample, held for as long as the loader)."""
        if self._sample_ids is None:
            self._sample_ids = self._ds.sample_ids
        return self._sample_ids

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call before each epoch, as with DistributedSampler)."""
        self.epoch = int(epoch)

    # -- which blocks this consumer reads

    def _blocks(self, consumer: int, consumers: int) -> list[_Block]:
        whole = []
        for k, groups in enumerate(self._groups):
            first = self._starts[k]
            for g, n in enumerate(groups):
                whole.append((k, g, first))
                first += n
        parts = max(1, -(-consumers // max(1, len(whole))))  # slices per block when blocks are few
        units = [_Block(k, g, first, p, parts) for k, g, first in whole for p in range(parts)]
        if self.shuffle_buffer:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(units))
            units = [units[i] for i in order]
        return units[consumer::consumers]

    # -- reading one block

    def _read(self, block: _Block, checked: set[int]) -> Iterator[dict[str, np.ndarray]]:
        """The block's chosen rows, a few samples at a time (a row group can be far larger than that)."""
        path, entry = self._paths[block.shard], self._entries[block.shard]
        if block.shard not in checked:
            _check_file(path, entry)
            checked.add(block.shard)
        # no pre-buffering: a row group's column chunks are read page by page, not held whole
        f = _parquet(path, entry)
        meta = fmt.read_metadata(f.schema_arrow, str(path))
        check_schema(f.schema_arrow, meta, str(path))
        first = block.first_sample  # the next sample to start; a long sample's later pieces belong to the one before
        pieces = [fmt.FIRST_ROW.name] if fmt.FIRST_ROW.name in f.schema_arrow.names else []
        if f.metadata.row_group(block.row_group).num_rows == 1:  # a piece (or one large sample): a column at a time
            yield self._one_row(path, entry, f, block, meta, first, pieces)
            return
        for batch in f.iter_batches(batch_size=SAMPLES_PER_READ, row_groups=[block.row_group],
                                    columns=self._base + pieces + self.columns, use_threads=False):
            table = pa.Table.from_batches([batch])
            starts = table.column(pieces[0]).to_numpy() == 0 if pieces else np.ones(table.num_rows, bool)
            check_row_bytes(table, {**meta, "layers": self._layers}, str(path))
            hidden = {g["name"]: _raw_rows(table.column(g["name"]), meta, g) for g in self._layers}
            rows = column_rows(table.column(self._layers[0]["name"]), meta, self._layers[0])
            del batch
            base = table.select(self._base + pieces)
            del table  # the hidden cells, decoded, are let go before the next batch is read
            yield self._rows(base, hidden, rows, meta, str(path), first - 1 + np.cumsum(starts), block)
            first += int(starts.sum())

    def _one_row(self, path: Path, entry: ShardEntry | None, f: pq.ParquetFile, block: _Block, meta: dict, first: int,
                 pieces: list[str]) -> dict[str, np.ndarray]:
        """The chosen rows of a row group of one Parquet row (a piece of a long sample, up to ``PIECE_BYTES`` a
        column): its columns read and decoded one at a time, each one's Arrow buffers let go before the next
        is read, so the memory is the decoded rows plus one column's read."""
        g = block.row_group
        try:
            base = f.read_row_group(g, columns=self._base + pieces, use_threads=False)
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{path}: unreadable Parquet ({e})") from None
        hidden, rows = {}, None
        for layer in self._layers:
            try:
                # a reader of its own per column: a ParquetFile keeps its last column chunk's compressed bytes
                reader = _parquet(path, entry, f.metadata)
                col = reader.read_row_group(g, columns=[layer["name"]], use_threads=False).column(0)
                del reader
            except (pa.ArrowException, OSError) as e:
                raise ShardError(f"{path}: unreadable Parquet ({e})") from None
            check_row_bytes(pa.table({layer["name"]: col}), {**meta, "layers": [layer]}, str(path))
            got = column_rows(col, meta, layer)
            if rows is None:
                rows = got
            hidden[layer["name"]] = _raw_rows(col, meta, layer)
            del col
            # pyarrow's default pool (mimalloc) keeps a freed read's large blocks, and the next piece's blocks
            # rarely have their sizes: handed back now, the pieces' reads reuse the same memory
            pa.default_memory_pool().release_unused()
        starts = base.column(pieces[0]).to_numpy() == 0 if pieces else np.ones(1, bool)
        return self._rows(base, hidden, rows, meta, str(path), first - 1 + np.cumsum(starts), block)

    def _rows(self, base: pa.Table, hidden: dict[str, np.ndarray], rows: np.ndarray, meta: dict, where: str,
              sample_of: np.ndarray, block: _Block) -> dict[str, np.ndarray]:
        """The chosen rows of a batch of Parquet rows (samples, or pieces of them: ``sample_of`` gives each one's
        sample, as a global index into the shards): ``hidden`` their decoded ``[R, row_bytes]`` rows by column,
        ``rows`` [P] how many each Parquet row holds."""
        ids, prompt, mask = (base.column(c).combine_chunks() for c in _BASE)
        first_row = base.column(fmt.FIRST_ROW.name).to_numpy() if fmt.FIRST_ROW.name in base.column_names else None
        images = base.column(fmt.IMAGE_MASK.name).combine_chunks() if fmt.IMAGE_MASK.name in self._base else None
        labels = row_labels(meta, ids, prompt, mask, rows, where, self.where, first_row, images)
        sample = sample_of[labels.owner]
        # a block shared by several consumers: each takes every parts-th sample
        wanted = labels.chosen & (sample % block.parts == block.part)
        chosen = np.flatnonzero(wanted)
        every = len(chosen) == len(wanted)
        # every row chosen: the decoded rows as they are, where they are fresh memory (not Arrow's)
        out = {name: r if every and r.flags.writeable else r[chosen] for name, r in hidden.items()}
        out["token_id"] = labels.token_id[chosen]
        out["next_token"] = labels.next_token[chosen]
        out["position"] = labels.position[chosen]
        out["sample_index"] = self._dataset_index[sample[chosen]]
        return out

    # -- iteration

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        consumer, consumers = self.rank * workers + worker, self.world_size * workers
        rng = np.random.default_rng([self.seed, self.epoch, consumer, 1])
        buffer = _ShuffleBuffer(self.shuffle_buffer, rng)
        batches = _Batcher(self.batch_size)
        checked: set[int] = set()
        blocks = self._blocks(consumer, consumers)
        stream = (rows for block in blocks for rows in self._read(block, checked))
        if self.read_ahead and any(is_remote(self._paths[b.shard]) for b in blocks):
            stream = _ahead(stream, self.read_ahead)  # the store's round trips overlap the decoding and the training
        for rows in stream:
            if self.shuffle_buffer:
                order = rng.permutation(len(rows["position"]))
                rows = {k: v[order] for k, v in rows.items()}
            for out in buffer.push(rows):
                yield from (self._tensors(b) for b in batches.add(out))
            rows = out = None  # a long sample's piece goes before the next one is read
        for out in buffer.drain():
            yield from (self._tensors(b) for b in batches.add(out))
        last = batches.flush()
        if last is not None and not self.drop_last:
            yield self._tensors(last)

    def _tensors(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        out = {}
        for g in self._layers:
            raw = torch.from_numpy(batch[g["name"]])  # [B, row_bytes] uint8, a fresh copy
            out[g["name"]] = raw.view(fmt.dtype_of(self.metadata["dtype"])).view(-1, g["width"])
        for k in LABELS:
            out[k] = torch.from_numpy(batch[k])
        return out


class _ShuffleBuffer:
    """Seeded row shuffle over ``capacity`` rows; rows pass straight through when capacity is 0."""

    def __init__(self, capacity: int, rng: np.random.Generator):
        self.capacity, self.rng = capacity, rng
        self.store: dict[str, np.ndarray] | None = None
        self.size = 0

    def push(self, rows: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        n = len(rows["position"])
        if self.capacity == 0:
            if n:
                yield rows
            return
        if self.store is None:
            self.store = {k: np.empty((self.capacity, *v.shape[1:]), dtype=v.dtype) for k, v in rows.items()}
        take = min(self.capacity - self.size, n)
        for k, v in rows.items():
            self.store[k][self.size:self.size + take] = v[:take]
        self.size += take
        step = max(1, self.capacity // 64)  # distinct slots are cheap to draw in small steps
        for i in range(take, n, step):
            j = min(n, i + step)
            slots = self.rng.choice(self.capacity, j - i, replace=False)
            out = {k: s[slots] for k, s in self.store.items()}  # copies: the slots are refilled next
            for k, v in rows.items():
                self.store[k][slots] = v[i:j]
            yield out

    def drain(self) -> Iterator[dict[str, np.ndarray]]:
        if self.store is None or self.size == 0:
            return
        order = self.rng.permutation(self.size)
        yield {k: s[:self.size][order] for k, s in self.store.items()}
        self.size = 0


class _Batcher:
    """Cuts a stream of row dicts into batches of exactly ``size`` rows (the last one may be short).

    A batch is a part that has exactly its rows, else a copy of the rows it takes (a slice of a part, or
    the parts it spans joined), so a batch kept keeps no more than its rows; a large part (a long
    sample's piece) is never copied whole to be cut, and once fewer than a batch of its rows wait,
    they are copied out of it so that it goes."""

    def __init__(self, size: int):
        self.size = size
        self.parts: deque[dict[str, np.ndarray]] = deque()
        self.count = 0
        self._cut = False  # the first part is the rest of a larger one

    def add(self, rows: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        if len(rows["position"]):
            self.parts.append(rows)
            self.count += len(rows["position"])
        while self.count >= self.size:
            yield self._take(self.size)
        if self._cut:  # fewer than a batch of rows wait: a copy of the cut part's rest frees the part (a piece)
            self.parts[0] = {k: v.copy() for k, v in self.parts[0].items()}
            self._cut = False

    def flush(self) -> dict[str, np.ndarray] | None:
        if self.count == 0:
            return None
        return self._take(self.count)

    def _take(self, n: int) -> dict[str, np.ndarray]:
        """The first ``n`` rows waiting."""
        taken, need = [], n
        self._cut = False
        while need:
            part = self.parts[0]
            m = len(part["position"])
            if m <= need:
                taken.append(self.parts.popleft())
                need -= m
            else:
                # a copy: a batch kept by the consumer must not keep the whole part (a piece) alive
                taken.append({k: v[:need].copy() for k, v in part.items()})
                self.parts[0] = {k: v[need:] for k, v in part.items()}
                self._cut = True
                need = 0
        self.count -= n
        if len(taken) == 1:
            return taken[0]
        return {k: np.concatenate([p[k] for p in taken]) for k in taken[0]}


def _ahead(items: Iterator, depth: int) -> Iterator:
    """``items``, produced on a thread of their own up to ``depth`` ahead of the consumer (an error is raised
    here, where the consumer takes the item it replaced); the thread ends when the consumer stops taking."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((done, None))
        except BaseException as e:  # handed to the consumer
            q.put((done, e))

    thread = threading.Thread(target=produce, name="hsx-loader-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if item is done:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # let a producer blocked on a full queue see the stop
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.1)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = torch.distributed
        live = dist.is_available() and dist.is_initialized()
        rank = (dist.get_rank() if live else 0) if rank is None else rank
        world_size = (dist.get_world_size() if live else 1) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise HsxError(f"rank {rank} is outside 0..{world_size - 1}")
    return int(rank), int(world_size)


def _layouts(paths: Sequence[Path]) -> tuple[list[Path], list[list[int]]]:
    """Every shard's file and the samples starting in each of its row groups (:func:`_row_groups`): a
    footer read or two a shard, which from a store are requests, made ``LAYOUT_THREADS`` shards at a
    time so that a loader over 20,000 shards starts in seconds, not minutes; a shard is looked for under
    its visible name first (:class:`~hsx.shards.reader.ShardPaths`)."""
    def one(k: int) -> tuple[Path, list[int]]:
        if isinstance(paths, ShardPaths):
            return paths.load(k, lambda path: (path, _row_groups(path)))
        return paths[k], _row_groups(paths[k])

    remote = len(paths) > 1 and is_remote(paths.directory if isinstance(paths, ShardPaths) else paths[0])
    if remote:
        with ThreadPoolExecutor(LAYOUT_THREADS, thread_name_prefix="hsx-layouts") as pool:
            got = list(pool.map(one, range(len(paths))))
    else:
        got = [one(k) for k in range(len(paths))]
    return [p for p, _ in got], [g for _, g in got]


def _row_groups(path: Path) -> list[int]:
    """Samples that start in each row group of a shard (a long sample's later pieces start none)."""
    try:
        f = pq.ParquetFile(open_ranged(path, 1 << 20))
        md = f.metadata
        if fmt.FIRST_ROW.name not in f.schema_arrow.names:
            return [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        return [int((f.read_row_group(g, columns=[fmt.FIRST_ROW.name]).column(0).to_numpy() == 0).sum())
                for g in range(md.num_row_groups)]
    except FileNotFoundError:
        raise ShardMissing(f"{path}: shard listed in the manifest is missing") from None
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{path}: unreadable Parquet ({e})") from None


def _parquet(path, entry: ShardEntry | None, metadata=None) -> pq.ParquetFile:
    """A shard opened to read row groups from, page by page (no pre-buffering: a row group's column chunks
    are not held whole); in an object store by ranged reads of what is read, never the whole object. Page
    CRCs are checked where no whole-file checksum was (no manifest entry, or an object in a store)."""
    return pq.ParquetFile(open_ranged(path), metadata=metadata, pre_buffer=False, buffer_size=1 << 20,
                          page_checksum_verification=entry is None or is_remote(path))


def _check_file(path: Path, entry: ShardEntry | None) -> None:
    """Size and whole-file checksum against the manifest (without one, page CRCs are checked on read). An
    object in a store has its size checked and its pages' CRCs on read: its checksum would mean reading it
    whole, where the loader reads only the row groups and columns it asks for."""
    if entry is None:
        return
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ShardError(f"{path}: shard listed in the manifest is missing") from None
    if size != entry.bytes:
        raise ShardError(f"{path}: {size} bytes on disk, manifest says {entry.bytes} (truncated or rewritten)")
    if is_remote(path):
        return
    with pa.OSFile(str(path)) as source:  # through one small buffer: a shard opened mid-pass adds next to nothing
        digest = checksum(source)
    if digest != entry.xxh3_128:
        raise ShardError(f"{path}: checksum {digest} does not match the manifest's {entry.xxh3_128} (corrupt)")


def _raw_rows(col: pa.ChunkedArray, meta: dict, group: dict) -> np.ndarray:
    """``[R, row_bytes]`` uint8 rows of a column: zero-copy (read-only) for the rows layout in one chunk, else
    decoded into fresh memory allocated once."""
    cells = Cells.of(meta, group)
    chunks = [c for c in col.chunks if len(c)]
    if len(chunks) == 1 and not cells.planes and type(cells) is Cells:
        return cells.block(chunks[0]).view(torch.uint8).numpy().reshape(-1, cells.row_bytes)
    counts = [int(cells.rows(c).sum()) for c in chunks]
    out = torch.empty((sum(counts), cells.width), dtype=cells.dtype)
    at = 0
    for c, n in zip(chunks, counts):
        cells.decode_into(c, out[at:at + n])
        at += n
    return out.view(torch.uint8).numpy().reshape(-1, cells.row_bytes)


def tokens_loader(path: str | Path, columns: Sequence[str] | None = None, where: str = "all", batch_size: int = 1024,
                  shuffle_buffer: int = 1 << 16, seed: int = 0, **kwargs) -> TokenLoader:
    """A :class:`TokenLoader` over the shards at ``path`` (see the module docstring)."""
    return TokenLoader(path, columns, where, batch_size, shuffle_buffer, seed, **kwargs)
