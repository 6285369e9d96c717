"""The online feed: a run's aligned samples straight into a training loop, with no shards in between.

:class:`Feed` runs the same stream as ``hsx extract`` (:func:`hsx.run.core.results`: the same rendering,
windows, engine scheduling and records) on a thread of its own and hands each item to the
consumer through a queue of at most ``ahead`` items: when the consumer is slower, the engine
waits (backpressure), so memory stays bounded however long the dataset is. Items are
:class:`~hsx.shards.writer.Record` (a sample: ``sample_id``, ``input_ids``, ``loss_mask``,
``hidden`` columns as tensors in the stored dtype, ...) and :class:`~hsx.run.core.Failure` (a bad
row, or a sample the engine gave up on: what ``extract`` stores as an error record). With
``ordered=True`` (the default) they come in source order, the order a reader of ``extract``'s
shards gives; a record that finishes before an earlier row of its window waits for it, so up to
one window of records (``cfg.window_rows``) is held on top of the queue.

Each iteration runs the dataset through the engine again (one epoch); the engine is loaded once.
An exception the engine raises (not a bad sample) ends the iteration with that exception.

With ``ray = true`` in the config the engines are Ray workers (:class:`hsx.run.scale.stream.RaySource`, the
workers and units of ``extract --ray``) and this process only receives their records; the run
ahead is then counted in units (``workers + ceil(ahead / unit rows)`` units at most).

A trainer of ``world_size`` processes (``rank`` and ``world_size``, by default ``RANK`` and
``WORLD_SIZE`` as torchrun sets them) shares one pool of Ray engine workers
(:mod:`hsx.run.scale.ranks`): each rank gets its :class:`Share` of every pass, record ``k`` of the run
(counted in source order, failures not counted) on rank ``k mod world_size``, the failure of
source row ``i`` on rank ``i mod world_size``. ``remainder`` evens out the last round: ``"keep"``
(ranks differ by at most one record), ``"drop"`` (the last ``n mod world_size`` records are given
to no rank) or ``"pad"`` (short ranks get a :class:`Padding`: a record of the pass repeated).
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import threading
from dataclasses import fields
from pathlib import Path
from typing import Iterable, Iterator

import torch

from hsx.config import ExtractConfig
from hsx.run.core import Failure, Progress, Resumed, RunSummary, results
from hsx.errors import HsxError
from hsx.run.report import libraries_quiet
from hsx.run.startup import open_rows, start
from hsx.shards.writer import Record

DEFAULT_AHEAD = 64  # items the engine may run ahead of the consumer
DEFAULT_RANK_TIMEOUT = 1800.0  # seconds a rank waits for another that takes nothing (torch's collectives wait as long)
REMAINDERS = ("keep", "drop", "pad")


class _End:
    pass


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def as_config(config: ExtractConfig | dict | str | Path) -> ExtractConfig:
    """An :class:`ExtractConfig` from itself, a dict of its fields, or a TOML/JSON config file."""
    if isinstance(config, ExtractConfig):
        return config
    if isinstance(config, dict):
        return ExtractConfig.from_dict(config)
    return ExtractConfig.from_file(config)


def in_source_order(items: Iterable) -> Iterator:
    """Records and failures by increasing source index, each held until every earlier row has come.

    Every source row gives exactly one record or failure, so row ``k`` is released once rows
    ``0 .. k-1`` are; whatever is still held at the end (rows resumed elsewhere) follows in order.
    """
    held: list = []
    tie = itertools.count()
    next_index = 0
    for item in items:
        heapq.heappush(held, (item.source_index, next(tie), item))
        while held and held[0][0] <= next_index:
            index, _, out = heapq.heappop(held)
            next_index = max(next_index, index + 1)
            yield out
    while held:
        yield heapq.heappop(held)[2]


def ranks_from(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: as given, else ``RANK`` and ``WORLD_SIZE`` from the environment (as
    torchrun sets them), else rank 0 of 1."""
    def env(name: str) -> int | None:
        value = os.environ.get(name)
        try:
            return None if value in (None, "") else int(value)
        except ValueError:
            raise HsxError(f"{name}={value!r} in the environment is not a whole number") from None

    world = world_size if world_size is not None else env("WORLD_SIZE") or 1
    if rank is None:
        rank = 0 if world == 1 else env("RANK")
    if rank is None:
        raise HsxError(f"world_size={world} needs rank= as well (or RANK in the environment, as torchrun sets it)")
    if world < 1 or not 0 <= rank < world:
        raise HsxError(f"rank {rank} of world_size {world}: needs 0 <= rank < world_size")
    return rank, world


class Padding(Record):
    """A record of the pass given again, to a rank whose share is one short (``remainder="pad"``):
    the same fields as the record it repeats. Train on it or skip it; ``summary`` does not count it."""

    @classmethod
    def of(cls, record: Record) -> "Padding":
        return cls(**{f.name: getattr(record, f.name) for f in fields(Record)})


class Share:
    """One rank's share of a pass whose items every rank sees, in source order (see the module docstring).

    :meth:`assign` takes the items (anything with ``source_index`` and ``failure``) and gives back
    ``(item, padding)`` for this rank's. ``records`` counts the pass's records on every rank,
    ``dropped`` the records given to no rank (``"drop"``), ``padded`` this rank's padding.
    """

    def __init__(self, rank: int, world_size: int, remainder: str = "keep"):
        if remainder not in REMAINDERS:
            raise HsxError(f"remainder must be one of {', '.join(REMAINDERS)}; got {remainder!r}")
        self.rank, self.world, self.remainder = rank, world_size, remainder
        self.records = self.dropped = self.padded = 0

    def assign(self, items: Iterable) -> Iterator[tuple]:
        first = []  # the pass's first world - 1 records: "pad" repeats them, as DistributedSampler repeats its first indices
        held = None  # "drop": this rank's record of a round not yet complete
        for item in items:
            if item.failure:
                if item.source_index % self.world == self.rank:
                    yield item, False
                continue
            k = self.records
            self.records += 1
            if k < self.world - 1:
                first.append(item)
            if k % self.world == self.rank:
                if self.remainder != "drop":
                    yield item, False
                else:
                    held = item
            if held is not None and k % self.world == self.world - 1:  # the round is complete
                yield held, False
                held = None
        short = self.records % self.world  # records of the last round
        if self.remainder == "drop":
            self.dropped = short
        elif self.remainder == "pad" and short and self.rank >= short:
            self.padded = 1
            yield first[(self.rank - short) % len(first)], True  # slot records + j goes to this rank: record j


class Feed(torch.utils.data.IterableDataset):
    """Records and failures of the run ``config`` describes, produced ``ahead`` at most in advance.

    ``metadata`` is what the shards of ``hsx extract`` with the same config would carry;
    ``summary`` counts the current (or last) pass as ``extract`` does and ``failures`` holds its
    failures. Use it with ``DataLoader(feed, batch_size=None)`` or iterate it;
    the engine lives in this process, so a DataLoader must keep ``num_workers=0``.

    With ``world_size`` > 1 it is rank ``rank``'s share of one pool of Ray engine workers that every
    rank of the job reaches (see the module docstring); every rank must build it with the same
    config and run the same passes. ``remainder`` is read when a pass starts and must be the same
    on every rank; ``share`` holds the current (or last) pass's counts. ``group`` names the job's
    pool where torchrun's run id does not tell two jobs apart; ``rank_timeout`` is how long a rank
    waits for another that takes nothing before the pass fails on it.
    """

    def __init__(self, config: ExtractConfig | dict | str | Path, *, ahead: int = DEFAULT_AHEAD, ordered: bool = True,
                 progress: bool = False, verbose: bool = False, rank: int | None = None, world_size: int | None = None,
                 remainder: str = "keep", group: str | None = None, rank_timeout: float = DEFAULT_RANK_TIMEOUT):
        self.cfg = as_config(config).validate(output=False)
        if ahead < 1:
            raise HsxError(f"ahead must be >= 1, got {ahead}")
        self.ahead, self.ordered, self.progress = ahead, ordered, progress
        self.rank, self.world_size = ranks_from(rank, world_size)
        self.share = Share(self.rank, self.world_size, remainder)  # the current (or last) pass's
        self.remainder = remainder
        if self.world_size > 1:
            _check_shared(self.cfg, self.rank, self.world_size, ordered, rank_timeout)
        ahead_units = -(-ahead // self.cfg.rows_per_unit)
        with libraries_quiet(verbose):  # the engine loads here: no loading bars unless asked, as in the CLI
            if self.world_size > 1:
                from hsx.run.scale import rank_source

                self.source = rank_source(self.cfg, self.rank, self.world_size, ahead_units, group, rank_timeout)
            elif self.cfg.ray:
                from hsx.run.scale import ray_source

                self.source = ray_source(self.cfg, ahead_units=ahead_units)
            else:
                self.source = _Local(self.cfg, ordered)
        self.engine = getattr(self.source, "engine", None)  # None when the engines are Ray workers
        self.rows, self.metadata = self.source.rows, self.source.metadata
        self.summary = RunSummary("")
        self.failures: list[Failure] = []

    def close(self) -> None:
        """Let go of the engine's workers (with ``ray``: the actors, and Ray if the feed started it)."""
        self.source.close()

    def __enter__(self) -> "Feed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        """Source rows in one pass (of the whole run: with ranks, all ranks' together): each gives one record or one failure."""
        return len(self.rows)

    def __iter__(self) -> Iterator[Record | Failure]:
        if torch.utils.data.get_worker_info() is not None:
            raise HsxError("the feed's engine runs in the process that made it: use DataLoader(num_workers=0)")
        items: queue.Queue = queue.Queue(maxsize=self.ahead)
        stop = threading.Event()
        self.summary, self.failures = RunSummary(""), []
        thread = threading.Thread(target=self._produce, args=(items, stop, self.summary), name="hsx-feed", daemon=True)
        thread.start()
        try:
            while True:
                item = items.get()
                if isinstance(item, _End):
                    return
                if isinstance(item, _Raised):
                    raise item.error
                if isinstance(item, Failure):
                    self.failures.append(item)
                else:
                    item.wait()  # on CUDA the host copies of the rows may still be in flight
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    items.get_nowait()
                except queue.Empty:
                    thread.join(0.05)

    def records(self) -> Iterator[Record]:
        """The records of one pass (failures still land in ``failures`` and ``summary.errors``)."""
        return (item for item in self if isinstance(item, Record))

    def _produce(self, items: queue.Queue, stop: threading.Event, summary: RunSummary) -> None:
        bar = Progress(-(-len(self.rows) // self.world_size), summary, self.progress)
        if self.world_size > 1:
            self.share = Share(self.rank, self.world_size, self.remainder)
            made = stream = self._shared(self.share)
        else:
            made = self.source.items()
            stream = in_source_order(made) if self.ordered else made
        try:
            for item in stream:
                if not isinstance(item, Padding):
                    summary.add(item)
                bar.update(item)
                if not _put(items, item, stop):
                    return
            _put(items, _End(), stop)
        except BaseException as e:  # handed to the consumer, raised there
            _put(items, _Raised(e), stop)
        finally:
            stream.close()  # a consumer that stopped early: the source lets go of its work (Ray: cancels units)
            made.close()
            bar.close()

    def _shared(self, share: Share) -> Iterator[Record | Failure]:
        """This rank's items of one pass of a pool shared by ranks: every unit's index, in source
        order, through ``share``; only this rank's items are fetched."""
        units = self.source.units(share.remainder)
        entries = in_source_order(entry for unit in units for entry in unit)
        finished = False
        try:
            for entry, padding in share.assign(entries):
                item = self.source.fetch(entry)
                yield Padding.of(item) if padding else item
            finished = True
        finally:
            entries.close()
            units.close()
            self.source.end_pass(finished)  # a pass stopped early ends on every rank


def _check_shared(cfg: ExtractConfig, rank: int, world: int, ordered: bool, rank_timeout: float) -> None:
    if not cfg.ray:
        raise HsxError(f"rank {rank} of {world}: a feed shared by ranks needs its engines on Ray (ray = true, every "
                       "rank on one cluster through ray_address); without Ray each rank would run an engine of its "
                       "own over the whole dataset. Use world_size=1 for a feed of this process alone")
    if not ordered:
        raise HsxError("ordered=False cannot be shared by ranks: the shares follow source order")
    if rank_timeout <= 0:
        raise HsxError(f"rank_timeout must be > 0 seconds, got {rank_timeout}")


class _Local:
    """The run's engine in this process, over the rows of ``cfg``."""

    def __init__(self, cfg: ExtractConfig, ordered: bool = True):
        self.cfg, self.ordered = cfg, ordered
        self.rows, dataset_meta = open_rows(cfg)
        run = start(cfg, self.rows.column_names, dataset_meta)
        self.engine, self.renderer, self.metadata = run.engine, run.renderer, run.metadata

    def items(self) -> Iterator[Record | Failure]:
        return (item for item in results(self.engine, enumerate(self.rows), self.renderer, self.cfg, ordered=self.ordered)
                if not isinstance(item, Resumed))  # (nothing is resumed: the feed has no output)

    def close(self) -> None:
        pass


def _put(items: queue.Queue, item, stop: threading.Event) -> bool:
    """Wait for room in the queue; False when the consumer has gone."""
    while not stop.is_set():
        try:
            items.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False
