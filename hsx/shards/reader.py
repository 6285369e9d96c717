"""Reading shards: ``hsx.open(path)`` -> :class:`ShardDataset` of :class:`Sample`.

Shards are loaded lazily, one file at a time, and checked before any number leaves them
(:mod:`hsx.shards.shard`: size and checksum, schema, metadata, each row group's cells as it is
read); at most ``cache_shards`` stay open. Hidden states come out read-only and unconverted: a
sample stored whole is a view of its row group's block (decoded once and kept, or for the rows
layout the Arrow buffer itself); a long sample's pieces (format 6) are decoded one at a time
straight into one tensor of its own, and ``rows=slice(a, b)`` decodes only the pieces that hold
those rows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import pyarrow as pa
import torch

from hsx.errors import HsxError, ShardError
from hsx.shards import format as fmt
from hsx.shards import positions
from hsx.shards.manifest import ErrorRecord, ShardEntry, load_manifest, manifest_path, shard_path
from hsx.shards.readonly import read_only
from hsx.shards.shard import Shard, ShardMissing, check_rows, fill, load_shard, parquet_row_rows
from hsx.storage.store import as_path

T = TypeVar("T")


class Sample:
    """One sequence. Hidden states: ``s.hidden(name)`` -> read-only ``[rows, W]`` view; row j is the state
    at token position ``s.positions[j]`` (position j, every one the mode covers, unless the run used ``--keep``)."""

    __slots__ = ("_shard", "_row", "index")

    def __init__(self, shard: Shard, row: int, index: int):
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
    def vision(self) -> dict | None:
        """A vision-language output's image columns of this sample (docs/FORMAT.md, "Images"), as a run
        hands them to the writer: ``image_mask [N]`` uint8, ``images`` (a dict per image), ``mrope_positions``
        ``[3 * N]`` int32 axis by axis (None without mRoPE) and ``rope_delta``; None for a text model's shards."""
        if not self._shard.metadata.get("vision"):
            return None
        return {"image_mask": self._shard.int_list("image_mask", self._row),
                "images": self._shard.scalar("images", self._row),
                "mrope_positions": self._shard.int_list("mrope_positions", self._row),
                "rope_delta": self._shard.scalar("rope_delta", self._row)}

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
               rows: np.ndarray, where: str, rule: str = "all", first_row: np.ndarray | None = None,
               image_mask: pa.ListArray | None = None) -> RowLabels:
    """Labels of the stored rows of a block of samples (one Arrow chunk per column), in ``where``.

    ``rows`` [S] are the block's stored row counts; they must match what the shard's ``keep`` rule
    gives for these tokens, else the rows would be labelled with the wrong positions. ``rule``
    (a :mod:`hsx.shards.positions` rule) marks the rows a reader wants in ``chosen``. A block of
    pieces (format 6, read without joining) gives each piece's ``first_row``: its rows are then the
    sample's rows ``first_row .. first_row + rows - 1``, and ``owner`` numbers the pieces. A rule
    with a token rule (``image``, ``text``) needs the samples' ``image_mask``.
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
    images = None
    if image_mask is not None:
        img_off = image_mask.offsets.to_numpy()
        if not np.array_equal(np.diff(img_off), n_tok):
            raise ShardError(f"{where}: image_mask lengths differ from the token counts of their samples")
        images = image_mask.values.to_numpy()[img_off[0]:img_off[-1]]
    chosen = positions.select(rule, meta["mode"], owner, pos, n_tok, prompt, mask, ids_off, images)
    return RowLabels(owner, pos, ids[at], nxt, chosen)


@dataclass
class TokenMatrix:
    """Every row of one column: ``hidden[r]`` belongs to sample ``sample_index[r]`` at ``position[r]``."""

    hidden: torch.Tensor  # [R, W]
    sample_index: torch.Tensor  # [R] int64, index into the dataset
    position: torch.Tensor  # [R] int64
    token_id: torch.Tensor  # [R] int64, the token at that position (the row's input)


class ShardPaths(Sequence):
    """Where each committed shard of an output is, found when first asked for: a shard whose crash left it under
    its staging name is found by a look at its own name (:func:`shard_path`), so opening an output of 20,000
    shards makes no request per shard (in a store, each look is a request)."""

    def __init__(self, directory: Path, names: list[str]):
        self._dir, self._names, self._found = directory, names, {}

    @property
    def directory(self) -> Path:
        return self._dir

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = range(len(self))[k]  # a negative index as a list takes it; out of range raises IndexError
        if k not in self._found:
            self._found[k] = shard_path(self._dir, self._names[k])
        return self._found[k]

    def load(self, k: int, load: Callable[[Path], T]) -> T:
        """``load(path)`` of shard ``k``, tried first under its visible name with no look beforehand (in a store
        the look is a request of its own), then, if it is not there (``load`` raises :class:`ShardMissing`),
        wherever :func:`shard_path` finds it."""
        if k in self._found:
            return load(self._found[k])
        path = as_path(self._dir) / self._names[k]
        try:
            got = load(path)
        except ShardMissing:
            path = self[k]
            got = load(path)
        self._found.setdefault(k, path)
        return got


class ShardDataset:
    """Samples of a directory of shards (or one shard file): in source order where the manifest lists
    source indices (format 3), else in manifest order."""

    def __init__(self, paths: Sequence[Path], entries: list[ShardEntry | None], counts: list[int], metadata: dict,
                 errors: list[ErrorRecord] = (), cache_shards: int = 4, index: np.ndarray | None = None,
                 cache_blocks: int | None = None):
        self._paths, self._entries, self._counts = paths, entries, counts
        self._cache_blocks = cache_blocks
        self.metadata = metadata
        self.errors = list(errors)
        self._cache: OrderedDict[int, Shard] = OrderedDict()
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

    def _shard(self, k: int) -> Shard:
        shard = self._cache.get(k)
        if shard is None:
            def load(path: Path) -> Shard:
                return load_shard(path, self._entries[k], self._cache_blocks)

            shard = self._paths.load(k, load) if isinstance(self._paths, ShardPaths) else load(self._paths[k])
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

    def tokens(self, name: str, shard: int | None = None, where: str = "all") -> TokenMatrix:
        """The rows of column ``name`` (one shard, or every shard) with their sample and position, in dataset
        order: samples as ``ds[i]`` numbers them, each one's rows in position order. ``where`` picks rows as
        the token loader's does (:func:`hsx.shards.positions.check_where`: ``loss``, ``image``, ``loss,text``...).

        The matrix is allocated once and each row group is decoded straight into its rows (memory: the
        matrix and one row group or piece being read); one row group in order is its block, a view. A
        ``where`` that drops some of a sample's rows decodes one shard's rows at a time and keeps the chosen."""
        if name not in self.columns:
            raise KeyError(f"no hidden-state column {name!r}; columns: {self.columns}")
        where = positions.check_where(where, self.metadata["mode"], bool(self.metadata.get("vision")))
        by_token = positions.split_where(where)[1] is not None
        shards = range(len(self._paths)) if shard is None else [shard]
        width = next(g["width"] for g in self.metadata["layers"] if g["name"] == name)
        dtype = fmt.dtype_of(self.metadata["dtype"])
        owner, pos, tok, chosen, plan = [], [], [], [], []
        global_of = np.full(self._starts[-1], -1, dtype=np.int64)
        global_of[self._index] = np.arange(len(self._index))
        at = 0
        for k in shards:
            s = self._shard(k)
            ids, prompt, mask = (s.meta.column(c).combine_chunks() for c in ("input_ids", "prompt_len", "loss_mask"))
            images = s.meta.column(fmt.IMAGE_MASK.name).combine_chunks() if by_token else None
            prow = parquet_row_rows(s, ids, prompt, mask)  # rows each Parquet row holds
            rows = np.add.reduceat(prow, s._span[:-1]) if len(prow) else np.zeros(0, np.int64)  # per sample
            labels = row_labels(s.metadata, ids, prompt, mask, rows, str(s.path), where, image_mask=images)
            owner.append(global_of[labels.owner + int(self._starts[k])])
            pos.append(labels.position)
            tok.append(labels.token_id)
            chosen.append(labels.chosen)
            plan.append((s, prow, rows, at))
            at += int(rows.sum())
        cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, dtype=np.int64)
        sample_index, position, token_id = cat(owner), cat(pos), cat(tok)
        every = all(bool(c.all()) for c in chosen)
        # rows in dataset order; samples outside a select() view (index -1) and rows ``where`` drops are dropped
        picked = sample_index >= 0
        if not every:
            picked &= np.concatenate(chosen)
        order = np.flatnonzero(picked)
        order = order[np.argsort(sample_index[order], kind="stable")]
        in_place = len(order) == len(sample_index) and bool(np.all(order == np.arange(len(order))))
        groups = [(s, g) for s, *_ in plan for g in range(len(s._group_start) - 1)
                  if s._group_start[g + 1] > s._group_start[g]]
        if len(groups) == 1 and in_place and groups[0][0]._whole_group[groups[0][1]]:
            (s, g), prow = groups[0], plan[0][1]
            h, starts = s.block(name, g)  # one row group in order: its block (a view for rows)
            check_rows(s, name, np.diff(starts), prow, 0)
        else:  # allocated once; each row group decoded straight into its samples' rows, then let go
            h = torch.empty((len(order), width), dtype=dtype)
            inv = None if in_place else np.full(len(sample_index), -1, np.int64)
            if inv is not None:
                inv[order] = np.arange(len(order))
            for s, prow, rows, base in plan:
                if every:
                    fill(s, name, h, prow, rows, base, inv)
                else:
                    _fill_some(s, name, h, prow, rows, inv[base:base + int(rows.sum())])
        as_torch = lambda a: torch.from_numpy(a if in_place else a[order])
        # the same contract whether h is a view or a copy: read-only, clone to modify
        return TokenMatrix(read_only(h), as_torch(sample_index), as_torch(position), as_torch(token_id))

    def __repr__(self) -> str:
        return f"ShardDataset({len(self)} samples, {len(self._paths)} shards, columns={self.columns})"


def _fill_some(s: Shard, name: str, out: torch.Tensor, prow: np.ndarray, rows: np.ndarray, dest: np.ndarray) -> None:
    """Shard ``s``'s rows of ``name`` that ``dest`` (its rows -> rows of ``out``, -1 dropped) keeps: the shard's
    rows decoded whole, then the kept ones copied."""
    keep = np.flatnonzero(dest >= 0)
    if not len(keep):
        return
    whole = torch.empty((len(dest), out.shape[1]), dtype=out.dtype)
    fill(s, name, whole, prow, rows, 0, None)
    out[torch.from_numpy(dest[keep])] = whole[torch.from_numpy(keep)]


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
    return np.argsort(np.concatenate([e.source_indices.array for e in entries]).astype(np.int64, copy=False), kind="stable")


def open_shards(path: str | Path, cache_shards: int = 4, cache_blocks: int | None = None) -> ShardDataset:
    """Open an hsx output directory (through its manifest) or a single shard file.

    ``cache_shards`` shards stay open (their small columns in memory); each keeps the row groups of whole
    samples it has decoded, at most ``cache_blocks`` of each column (and as many read for partial reads;
    None: all of them). A reader that goes through the samples once, like the exports, needs one or two."""
    path = as_path(path)  # a local path, or s3://bucket/prefix
    if path.is_dir():
        m = load_manifest(path)
        paths = ShardPaths(path, [s.file for s in m.shards])
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
    shard = load_shard(path, entry, cache_blocks)
    ds = ShardDataset([path], [entry], [shard.meta.num_rows], shard.metadata, (), cache_shards, None, cache_blocks)
    ds._cache[0] = shard
    return ds
