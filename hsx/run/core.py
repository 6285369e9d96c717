"""The stream every run is made of: dataset rows -> rendered prompts -> engine -> aligned records.

``hsx extract`` (:mod:`hsx.run.pipeline`), a Ray worker (:mod:`hsx.run.scale`) and the online feed
(:mod:`hsx.run.feed`) all drive :func:`results`; they differ only in where its items go (a shard sink
through :func:`write_results`, or a training loop). Nothing here writes a file.

:func:`results` yields, in the order the run produces them:

* :class:`~hsx.shards.writer.Record`: a finished sample, its rows in the stored dtype;
* :class:`Failure`: a row with no sample (bad input, a repeated id, a sample the engine gave up on);
* :class:`Resumed`: rows skipped because the output already holds them.

Every source row ends as exactly one Record, Failure or count in a Resumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from tqdm.auto import tqdm

from hsx.config import ExtractConfig
from hsx.errors import SampleError
from hsx.shards.positions import sample_positions
from hsx.shards.writer import Record


@dataclass(frozen=True)
class Failure:
    """A source row that gives no sample, and why (stored as an error record by ``extract``)."""

    sample_id: str
    source_index: int
    reason: str


@dataclass(frozen=True)
class Resumed:
    """``count`` rows the output already holds (written or recorded as errors): not run again."""

    count: int


@dataclass
class RunSummary:
    output: str
    samples: int = 0  # written by this run
    resumed: int = 0  # already in the output (written or recorded as errors) and skipped
    errors: int = 0  # error records made by this run (bad input, or a sample the engine gave up on)
    tokens: int = 0
    completion_tokens: int = 0
    rows: int = 0
    no_rows: int = 0  # samples stored with no rows: --keep kept none of their positions (a chat with no assistant turn)
    verify_steps: int = 0
    accepted: int = 0
    bytes: int = 0
    seconds: float = 0.0
    workers: int = 0  # Ray workers (0: this process ran the engine)
    retried: int = 0  # units sent to another worker after theirs was lost
    writer_blocked_s: float = 0.0  # the engine's thread waited this long for the shard writer (backpressure)
    writer_busy_s: float = 0.0  # the shard writer's thread spent this long encoding and writing

    def count(self, record: Record) -> None:
        completion = record.input_ids.numel() - record.prompt_len
        self.samples += 1
        self.tokens += record.input_ids.numel()
        self.completion_tokens += completion
        self.rows += record.num_rows  # stored rows (--keep may store fewer than the engine produced)
        self.no_rows += record.num_rows == 0
        if record.accept_lens is not None:
            self.verify_steps += record.accept_lens.numel()
            self.accepted += int(record.accept_lens.sum())
        elif record.verify_steps:  # count only: every completion token after the first came from a step
            self.verify_steps += record.verify_steps
            self.accepted += completion - 1

    def add(self, item) -> None:
        """Count one item of :func:`results`."""
        if isinstance(item, Record):
            self.count(item)
        elif isinstance(item, Failure):
            self.errors += 1
        else:
            self.resumed += item.count

    @property
    def mean_accept_len(self) -> float | None:
        return self.accepted / self.verify_steps if self.verify_steps else None


class Progress:
    """A run's progress bar: source rows done, tokens per second (from the bar's start: after the
    model has loaded), errors; with an engine that reports its forwards (:meth:`tokens`), also the
    prompt tokens prefilled and the tokens generated out of what the engine holds, and the time
    those will take at the rates so far (``eta``): so a long prompt moves the bar before it ends."""

    REDRAW_S = 0.5  # token reports redraw the bar at most this often

    def __init__(self, total: int, summary: RunSummary, enabled: bool = True):
        self.bar = tqdm(total=total, unit="sample", disable=not enabled, dynamic_ncols=True)
        self.summary, self.t0 = summary, time.perf_counter()
        self.counts = dict(queued=0, prompt=0, generated=0, budget=0)
        self.prompt_s = self.generate_s = 0.0  # seconds spent prefilling, generating (between reports)
        self.last = self.drawn = self.t0
        self.resumed = 0  # rows the output held already, taken off the total

    def update(self, item) -> None:
        """Count one item of :func:`results`. A :class:`Resumed` takes its rows off the bar's total instead:
        rows skipped in a moment counted as done would make the rate, and so the bar's own ETA, a lie for
        the rest of a resumed run (half a million rows skipped in a second read as 500,000 samples/s)."""
        if isinstance(item, Resumed):
            self.resumed += item.count
            self.bar.total -= item.count
            self.bar.set_postfix_str(self._postfix())
            return
        # the postfix goes first: update() draws it (one set after the draw shows a sample late)
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        self.bar.update(1)

    def tokens(self, queued: int = 0, prompt: int = 0, generated: int = 0, budget: int = 0) -> None:
        """An engine's report (:meth:`hsx.engine.contract.Runner.watch_tokens`)."""
        now = time.perf_counter()
        if prompt:
            self.prompt_s += now - self.last
        if generated:
            self.generate_s += now - self.last
        self.last = now
        for key, n in (("queued", queued), ("prompt", prompt), ("generated", generated), ("budget", budget)):
            self.counts[key] += n
        if now - self.drawn >= self.REDRAW_S:
            self.drawn = now
            self.bar.set_postfix_str(self._postfix())

    def _postfix(self) -> str:
        s, c = self.summary, self.counts
        resumed = f", resumed {self.resumed:,}" if self.resumed else ""
        if not c["queued"]:  # the engine reports nothing: samples and their tokens only
            return f"tok_s={s.tokens / max(time.perf_counter() - self.t0, 1e-9):,.0f}, errors={s.errors}{resumed}"
        parts = [f"prompt {c['prompt']:,}/{c['queued']:,} tok"]
        if c["budget"]:
            parts.append(f"generated {c['generated']:,}/<={c['budget']:,} tok")
        eta = self.eta()
        parts.append("eta ?" if eta is None else f"eta {_clock(eta)}")
        return ", ".join(parts) + f", errors={s.errors}{resumed}"

    def eta(self) -> float | None:
        """Seconds the tokens the engine holds will take: prompt tokens left at the prefill rate so far,
        plus the completion budget left (an upper bound: requests may stop early) at the generation
        rate so far; None until both rates that are needed are known."""
        c = self.counts
        left = {"prompt": c["queued"] - c["prompt"], "generated": c["budget"] - c["generated"]}
        seconds = {"prompt": self.prompt_s, "generated": self.generate_s}
        total = 0.0
        for key, n in left.items():
            if n <= 0:
                continue
            if not c[key] or not seconds[key]:
                return None
            total += n * seconds[key] / c[key]
        return total

    def close(self) -> None:
        self.bar.close()


def _clock(seconds: float) -> str:
    """``1:05:07``, ``4:12``, ``0:09``: as tqdm shows its own times."""
    m, s = divmod(int(seconds + 0.5), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def pending_prompts(rows: Iterable, renderer, done: set[str]) -> Iterator:
    """``(prompt, done)`` for the rendered rows of ``(index, row)`` pairs, ``done`` when the output
    already holds the sample; bad rows and repeated ids become :class:`Failure` instead."""
    seen: set[str] = set()
    for index, row in rows:
        try:
            p = renderer.render(row, index)
        except SampleError as e:
            yield Resumed(1) if e.sample_id in done else Failure(e.sample_id, index, e.reason)
            continue
        if p.sample_id in seen:
            yield Resumed(1) if p.sample_id in done else \
                Failure(p.sample_id, index, f"duplicate sample id {p.sample_id!r} (also at an earlier row)")
            continue
        seen.add(p.sample_id)
        yield p, p.sample_id in done


def windows(items: Iterator, size: int) -> Iterator:
    """Lists of the ``(prompt, done)`` pairs whose source rows share a window ``[k * size, (k + 1) * size)``;
    the other items (failures, resumed counts) are passed on as they come.

    A window never depends on which rows were skipped or where a work unit starts, so the engine
    schedules the same requests together for a sample in a fresh run, a resumed one, a Ray
    worker's unit and the online feed: which requests share a forward changes the bits of the rows.
    """
    window, key = [], None
    for item in items:
        if not isinstance(item, tuple):
            yield item
            continue
        k = item[0].source_index // size
        if window and k != key:
            yield window
            window = []
        window.append(item)
        key = k
    if window:
        yield window


def make_record(prompt, sample, mode: str, keep: str) -> Record:
    """The record of one engine sample: the prompt's loss mask (generate: every generated token
    learned) and the rows of the positions ``keep`` names."""
    loss_mask = torch.tensor(prompt.loss_mask, dtype=torch.uint8)
    if mode == "generate":  # the renderer masks the prompt; every generated token is learned
        completion = sample.input_ids.numel() - sample.prompt_len
        loss_mask = torch.cat([loss_mask, torch.ones(completion, dtype=torch.uint8)])
    hidden = sample.hidden
    if keep != "all":  # rows of the other positions are dropped here, by the rule readers apply again
        sample.wait()  # (on CUDA the host copies may still be in flight)
        pos = torch.from_numpy(sample_positions(keep, mode, sample.input_ids.numel(), sample.prompt_len, loss_mask.numpy()))
        hidden = {name: h[pos] for name, h in hidden.items()}
    return Record(prompt.sample_id, prompt.source_index, sample.input_ids, sample.prompt_len, loss_mask,
                  sample.finish_reason, hidden, sample.accept_lens, sample.verify_steps, ready=sample.ready,
                  vision=sample.vision)


def results(engine, rows: Iterable, renderer, cfg: ExtractConfig, done: set[str] = frozenset(),
            ordered: bool = True) -> Iterator:
    """Records, failures and resumed counts for ``(index, row)`` pairs, one window of
    ``cfg.window_rows`` source rows at a time (see the module docstring).

    The engine schedules a window as it likes (length order, continuous batching) and hands back
    each result as it finishes; ``ordered`` puts a window's results back in source order (holding
    at most one window's finished samples), so that shards list their samples in dataset order. A
    window whose samples are all in ``done`` is skipped; one that is only partly there (a run
    stopped inside it) is run whole again and the samples already written are dropped, so every
    row has the bits a fresh run gives.
    """
    for window in windows(pending_prompts(rows, renderer, done), cfg.window_rows):
        if not isinstance(window, list):
            yield window
            continue
        written = {p.sample_id for p, is_done in window if is_done}
        yield Resumed(len(written))
        if len(written) == len(window):
            continue
        prompts = [p for p, _ in window]
        finished = engine.stream(prompts)
        for prompt, sample in (in_window_order(finished, prompts) if ordered else finished):
            if prompt.sample_id in written:
                continue
            if isinstance(sample, SampleError):  # an engine may give up on one sample and go on
                yield Failure(prompt.sample_id, prompt.source_index, sample.reason)
            else:
                yield make_record(prompt, sample, cfg.mode, cfg.keep)


def in_window_order(finished: Iterable[tuple], prompts: list) -> Iterator[tuple]:
    """``(prompt, result)`` pairs in any order -> the order of ``prompts``, each pair held until every
    earlier prompt's has come (an engine hands back each prompt of a window exactly once)."""
    held, at = {}, 0
    for prompt, result in finished:
        held[prompt.source_index] = (prompt, result)
        while at < len(prompts) and prompts[at].source_index in held:
            yield held.pop(prompts[at].source_index)
            at += 1
    yield from (held[k] for k in sorted(held))


def write_results(items, sink, summary: RunSummary, after=lambda item: None) -> None:
    """Put the items of :func:`hsx.run.core.results` into ``sink`` (records as samples, failures as error
    records) and count them in ``summary``; ``after(item)`` is called for each."""
    for item in items:
        if isinstance(item, Record):
            sink.add(item)
        elif isinstance(item, Failure):
            sink.add_error(item.sample_id, item.source_index, item.reason)
        summary.add(item)
        after(item)
