"""The online feed: a run's aligned samples straight into a training loop, with no shards in between.

:class:`Feed` runs the same stream as ``hsx extract`` (:func:`hsx.core.results`: the same rendering,
windows, engine scheduling and records) on a thread of its own and hands each item to the
consumer through a queue of at most ``ahead`` items: when the consumer is slower, the engine
waits (backpressure), so memory stays bounded however long the dataset is. Items are
:class:`~hsx.shards.writer.Record` (a sample: ``sample_id``, ``input_ids``, ``loss_mask``,
``hidden`` columns as tensors in the stored dtype, ...) and :class:`~hsx.core.Failure` (a bad
row, or a sample the engine gave up on: what ``extract`` stores as an error record). With
``ordered=True`` (the default) they come in source order, the order a reader of ``extract``'s
shards gives; a record that finishes before an earlier row of its window waits for it, so up to
one window of records (``cfg.window_rows``) is held on top of the queue.

Each iteration runs the dataset through the engine again (one epoch); the engine is loaded once.
An exception the engine raises (not a bad sample) ends the iteration with that exception.

With ``ray = true`` in the config the engines are Ray workers (:class:`hsx.scale.stream.RaySource`, the
workers and units of ``extract --ray``) and this process only receives their records; the run
ahead is then counted in units (``workers + ceil(ahead / unit rows)`` units at most).
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
from pathlib import Path
from typing import Iterable, Iterator

import torch

from hsx.config import ExtractConfig
from hsx.core import Failure, Progress, Resumed, RunSummary, make_renderer, open_rows, results, run_metadata
from hsx.errors import HsxError
from hsx.report import libraries_quiet
from hsx.shards.writer import Record

DEFAULT_AHEAD = 64  # items the engine may run ahead of the consumer


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


class Feed(torch.utils.data.IterableDataset):
    """Records and failures of the run ``config`` describes, produced ``ahead`` at most in advance.

    ``metadata`` is what the shards of ``hsx extract`` with the same config would carry;
    ``summary`` counts the current (or last) pass as ``extract`` does and ``failures`` holds its
    failures. Use it with ``DataLoader(feed, batch_size=None)`` or iterate it;
    the engine lives in this process, so a DataLoader must keep ``num_workers=0``.
    """

    def __init__(self, config: ExtractConfig | dict | str | Path, *, ahead: int = DEFAULT_AHEAD, ordered: bool = True,
                 progress: bool = False, verbose: bool = False):
        self.cfg = as_config(config).validate(output=False)
        if ahead < 1:
            raise HsxError(f"ahead must be >= 1, got {ahead}")
        self.ahead, self.ordered, self.progress = ahead, ordered, progress
        with libraries_quiet(verbose):  # the engine loads here: no loading bars unless asked, as in the CLI
            if self.cfg.ray:
                from hsx.scale import ray_source

                self.source = ray_source(self.cfg, ahead_units=-(-ahead // self.cfg.rows_per_unit))
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
        """Source rows in one pass: each gives one record or one failure."""
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
        bar = Progress(len(self.rows), summary, self.progress)
        made = self.source.items()
        stream = in_source_order(made) if self.ordered else made
        try:
            for item in stream:
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


class _Local:
    """The run's engine in this process, over the rows of ``cfg``."""

    def __init__(self, cfg: ExtractConfig, ordered: bool = True):
        from hsx.engine.loader import build_engine

        self.cfg, self.ordered = cfg, ordered
        self.rows, dataset_meta = open_rows(cfg)
        self.engine = build_engine(cfg)
        self.renderer, chat_template = make_renderer(cfg, self.engine, self.rows.column_names)
        self.metadata = run_metadata(cfg, self.engine, chat_template, dataset_meta)

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
