"""A long sample checked a chunk of tokens at a time, its memory bounded by the chunk, not the sample.

The reference is the same teacher-forced forward, run over the sample's tokens ``chunk`` at a time
through a KV cache (:meth:`hsx.recompute.reference.Reference.chunks`). The stored rows of a chunk's
positions are read alone (``Sample.hidden(name, rows=slice(a, b))``) and checked as
:func:`hsx.compare.check.check_segment` checks a batch, over a window: the chunk's positions
plus up to ``HALO`` positions on each side, whose states the position test searches too (so rows
shifted across a chunk's edge still match their neighbours) but whose rows are checked with their
own chunk. A chunk is checked once the next one's states exist; at most two chunks' states and
one chunk's stored rows are held at a time.

What differs from one forward over the whole sample: the position test searches the window, not
the whole sample (a row matching a state further away is a ``mismatch``, not a ``position``), the
median norm m of the relative error is the window's, and the forward's rounding differs by the
chunked matmuls' (float32: ~1e-7 relative). Runs of faulty rows that continue across a chunk's
edge are joined into one finding.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hsx.align import LayerGroup
from hsx.recompute import rows as R
from hsx.compare.check import Tolerance, check_segment
from hsx.recompute.reference import Reference, neighbour_sources, same_width
from hsx.recompute.results import SampleResult, SourceResult, describe, join_runs, runs_of, source_label

HALO = 64  # positions on each side of a chunk whose states its rows' position test searches too


def check_in_chunks(ref: Reference, sample, index: int, groups: Sequence[LayerGroup], tol: Tolerance, mode: str,
                    chunk: int, sources: dict | None = None) -> SampleResult:
    """Check one sample ``chunk`` tokens at a time; ``sources`` accumulates per-column-source statistics."""
    num_layers = ref.shape.num_layers
    sid = R.sample_id(sample, index)
    ids = R.token_ids(sample)
    placed = R.positions(sample, mode)  # [R] ascending
    result = SampleResult(sid, 0)
    got = R.num_rows(sample, groups[0].name) if groups else 0
    result.rows = min(got, len(placed))
    count = R.count_finding(sid, groups[0].name, got, len(placed), ids.numel(), mode) if groups else None
    if count is not None:
        result.findings.append(count)
    wanted = [s for g in groups for s in (*g.sources, *neighbour_sources(g.sources, num_layers))]
    checker = _Checker(ref, sample, sid, groups, tol, placed[: result.rows], result, sources)
    waiting, tail = None, {}  # the chunk whose check waits for the next one's states; the states before it
    for start, stop, states in ref.chunks(ids, wanted, chunk):
        if waiting is not None:
            checker.check(*waiting, tail, {s: v[:, :HALO] for s, v in states.items()})
            tail = {s: torch.cat([tail[s], v], 1)[:, -HALO:].clone() if tail else v[:, -HALO:].clone()
                    for s, v in waiting[2].items()}  # a copy: the chunk's states are freed
        waiting = (start, stop, states)
    if waiting is not None:
        checker.check(*waiting, tail, {})
    result.findings += checker.findings()
    return result


class _Checker:
    """The checks of one sample's chunks, with the runs of faulty rows they found so far."""

    def __init__(self, ref, sample, sid, groups, tol, placed, result, sources):
        self.ref, self.sample, self.sid, self.groups, self.tol = ref, sample, sid, groups, tol
        self.placed, self.result, self.sources = placed, result, sources
        self.runs: dict[tuple[str, int, int | str], list] = {}  # (column, part, source) -> runs, in position order
        self.labels: dict[int | str, list[str]] = {}

    def check(self, start: int, stop: int, states: dict, before: dict, after: dict) -> None:
        """Check the stored rows at positions ``start..stop-1`` against ``states`` (``[1, q, H]`` per source),
        the window widened by the states of the positions ``before`` and ``after`` it."""
        num_layers = self.ref.shape.num_layers
        own = {s: torch.cat([t for t in (before.get(s), v, after.get(s)) if t is not None], 1) for s, v in states.items()}
        lead = before[next(iter(before))].shape[1] if before else 0
        first = start - lead  # the window's position 0
        width = next(iter(own.values())).shape[1]
        r0, r1 = (int(x) for x in torch.searchsorted(self.placed, torch.tensor([start, stop])))
        at = (self.placed[r0:r1] - first).to(self.ref.device)  # window positions of the chunk's rows
        valid = torch.zeros(1, width, dtype=torch.bool, device=self.ref.device)
        valid[0, at] = True
        n_tokens = torch.tensor([width])
        for g in self.groups:
            block = torch.zeros(1, width, g.width, device=self.ref.device)  # [1, W, width]
            block[0, at] = R.hidden(self.sample, g.name, slice(r0, r1)).to(device=self.ref.device, dtype=torch.float32)
            for k, (src, (a, b)) in enumerate(zip(g.sources, self.ref.shape.spans(g.sources))):
                alts = same_width(self.ref.shape, src, neighbour_sources([src], num_layers))
                labels = self.labels.setdefault(src, [source_label(x, num_layers) for x in (src, *alts)])
                check = check_segment(block[:, :, a:b], valid, own[src], [own[x] for x in alts], n_tokens, self.tol)
                if self.sources is not None:
                    self.sources.setdefault((g.name, src), SourceResult(g.name, src)).add(check, labels)
                r = self.result
                r.worst_rel = max(r.worst_rel, float(check.rel.nan_to_num(nan=float("inf")).max()))
                r.worst_cos = min(r.worst_cos, float(check.cos.nan_to_num(nan=-1.0).min()))
                join_runs(self.runs.setdefault((g.name, k, src), []), runs_of(check, 0, [self.sid], labels, first))
            del block

    def findings(self) -> list:
        return [describe(run, 0, [self.sid], column, source, self.labels[source], self.tol)
                for (column, _, source), runs in self.runs.items() for run in runs]
