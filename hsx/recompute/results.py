"""What a recompute reports: findings (runs of faulty rows with one diagnosis), per-sample and
per-column results, and the whole run's summary."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import torch

from hsx.align import FINAL
from hsx.compare.check import (BOUNDARY, KINDS, MISMATCH, NONFINITE, POSITION, REPEAT, SAMPLE, ZERO,
                                   SegmentCheck, Tolerance)

MISALIGNED = {"position", "sample", "boundary", "zero", "repeat", "count", "positions"}


def source_label(source: int | str, num_layers: int) -> str:
    if source == FINAL:
        return "final (after the final norm)"
    return f"boundary {source}" + (" (before the final norm)" if source == num_layers else "")


@dataclass
class Finding:
    """Consecutive faulty rows of one sample and one column source that share a diagnosis."""

    sample_id: str
    column: str
    source: int | str
    first: int  # first and last position of the run
    last: int
    rows: int
    kind: str  # one of compare.KINDS (not "ok"), "count" for a wrong number of rows, "positions" for stored
    # mRoPE positions or rope_delta other than the model's rope index
    matched: str  # what the rows match instead, in words ("" when nothing)
    worst_rel: float
    message: str


@dataclass
class SampleResult:
    sample_id: str
    rows: int  # positions checked (each checked in every column)
    worst_rel: float = 0.0
    worst_cos: float = 1.0
    findings: list[Finding] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        kinds = {f.kind for f in self.findings}
        if not kinds:
            return "ok"
        if kinds & MISALIGNED:
            return "misaligned"
        return "non-finite" if kinds == {"nonfinite"} else "wrong values"


@dataclass
class SourceResult:
    """One source of one column over every checked sample: the per-layer error distribution."""

    column: str
    source: int | str
    rows: int = 0
    bad_rows: int = 0
    worst_rel: float = 0.0
    worst_cos: float = 1.0
    sum_rel: float = 0.0
    matched: dict[str, int] = field(default_factory=dict)  # diagnosis -> rows, for faulty rows
    # the layer test over the whole column: mean relative error against each neighbouring source
    layer_mean: dict[str, float] = field(default_factory=dict)
    matches: str | None = None  # set by finish(): a neighbouring source the column matches better than its own
    _layer_sum: dict = field(default_factory=dict, repr=False)

    @property
    def mean_rel(self) -> float:
        return self.sum_rel / self.rows if self.rows else 0.0

    def finish(self, margin: float) -> None:
        """Decide the column-level layer test: averaged over every row, rounding noise cancels and a
        column holding another boundary shows even where each row alone is within the limit."""
        self.layer_mean = {k: s / n for k, (s, n) in self._layer_sum.items() if n}
        best = min(self.layer_mean.items(), key=lambda kv: kv[1], default=None)
        if best is not None and best[1] < margin * self.mean_rel:
            self.matches = best[0]

    def add(self, check: SegmentCheck, labels: list[str]) -> None:
        """Fold in one batch; ``labels[k]`` names source index k of the check's [own, *alternatives]."""
        valid = check.valid
        self.rows += int(valid.sum())
        if not bool(valid.any()):
            return
        rel = check.rel[valid].nan_to_num(nan=float("inf"))
        self.worst_rel = max(self.worst_rel, float(rel.max()))
        self.worst_cos = min(self.worst_cos, float(check.cos[valid].nan_to_num(nan=-1.0).min()))
        self.sum_rel += float(rel[torch.isfinite(rel)].double().sum())
        for label, alt in zip(labels[1:], check.layer_rel):
            a = alt[valid]
            a = a[torch.isfinite(a)]
            s, n = self._layer_sum.get(label, (0.0, 0))
            self._layer_sum[label] = (s + float(a.double().sum()), n + a.numel())
        bad = check.kind != 0
        self.bad_rows += int(bad.sum())
        counts = Counter()
        kinds, srcs = check.kind[bad].tolist(), check.match_source[bad].tolist()
        for k, s in zip(kinds, srcs):
            counts[labels[s] if k == BOUNDARY else KINDS[k]] += 1
        for key, n in counts.items():
            self.matched[key] = self.matched.get(key, 0) + n


@dataclass
class RecomputeReport:
    path: str
    model: str
    device: str
    compute_dtype: str
    stored_dtype: str
    engine_compute_dtype: str | None
    tolerance: dict
    samples_total: int  # in the shards
    samples: list[SampleResult] = field(default_factory=list)
    sources: list[SourceResult] = field(default_factory=list)
    rows: int = 0  # positions checked
    row_checks: int = 0  # rows x column sources
    tokens: int = 0  # tokens run through the recompute
    seconds: float = 0.0  # the whole check, model loading included
    load_seconds: float = 0.0
    chunk: int | str | None = None  # the chunk setting: "auto", N tokens, None (every sample in one forward)
    chunked_samples: int = 0  # how many samples that was

    @property
    def ok(self) -> bool:
        return all(not s.findings for s in self.samples) and all(c.matches is None for c in self.sources)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def check_rows_per_s(self) -> float:
        """Rows per second of the check itself, model loading excluded."""
        run = self.seconds - self.load_seconds
        return self.rows / run if run > 0 else 0.0

    @property
    def findings(self) -> list[Finding]:
        return [f for s in self.samples for f in s.findings]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for s, sd in zip(self.samples, d["samples"]):
            sd["verdict"] = s.verdict
        for s, sd in zip(self.sources, d["sources"]):
            sd["mean_rel"] = s.mean_rel
            sd.pop("sum_rel")
            sd.pop("_layer_sum")
        return {**d, "ok": self.ok, "rows_per_s": self.rows_per_s, "check_rows_per_s": self.check_rows_per_s}


@dataclass
class Run:
    """Consecutive faulty rows of one sample and column source with one diagnosis, before it is put in
    words: what :func:`describe` needs, so that runs found in consecutive chunks of a long sample can be
    joined first (:func:`join_runs`)."""

    kind: int  # code into compare.KINDS
    sample: int  # batch index of the sample the rows match (-1: none)
    offset: int  # matched position - own position
    source: int  # index into the labels of the check's sources (-1: none)
    first: int  # first and last position of the run
    last: int
    rows: int
    worst_rel: float
    worst_cos: float
    closest: str  # the nearest state of the run's first row, in words

    def key(self) -> tuple:
        return self.kind, self.sample, self.offset, self.source


def runs_of(check: SegmentCheck, i: int, sample_ids: list[str], labels: list[str], start: int = 0,
            limit: int = 20) -> list[Run]:
    """Sample ``i``'s faulty rows in ``check`` as runs of one diagnosis (the first ``limit``); ``start`` is the
    token position of the check's column 0 (a chunk of a long sample), added to every position."""
    bad = (check.kind[i] != 0).nonzero()[:, 0]  # [F] positions, ascending
    if not bad.numel():
        return []
    kind = check.kind[i, bad]
    placed = (kind == POSITION) | (kind == SAMPLE) | (kind == BOUNDARY)
    offset = torch.where(placed, check.match_position[i, bad] - bad, torch.zeros_like(bad))
    key = torch.stack([kind, torch.where(placed, check.match_sample[i, bad], -1), offset,
                       torch.where(placed, check.match_source[i, bad], -1)], 1)  # [F, 4]
    new_run = torch.ones_like(bad, dtype=torch.bool)
    new_run[1:] = (bad[1:] != bad[:-1] + 1) | (key[1:] != key[:-1]).any(1)
    starts = new_run.nonzero()[:, 0].tolist() + [bad.numel()]
    out = []
    for a, b in zip(starts[:limit], starts[1:]):
        rows = bad[a:b]
        worst = float(check.rel[i, rows].nan_to_num(nan=float("inf")).max())
        cos = float(check.cos[i, rows].nan_to_num(nan=-1.0).min())
        out.append(Run(*key[a].tolist(), int(bad[a]) + start, int(bad[b - 1]) + start, b - a, worst, cos,
                       _closest(check, i, int(bad[a]), sample_ids, labels, start)))
    return out


def join_runs(runs: list[Run], new: list[Run], limit: int = 20) -> None:
    """Append ``new`` (found after ``runs``, further along the sample) to ``runs`` in place: a run that
    continues the last one (the next position, the same diagnosis) extends it; at most ``limit`` runs."""
    for r in new:
        last = runs[-1] if runs else None
        if last is not None and r.key() == last.key() and r.first == last.last + 1:
            last.last, last.rows = r.last, last.rows + r.rows
            last.worst_rel, last.worst_cos = max(last.worst_rel, r.worst_rel), min(last.worst_cos, r.worst_cos)
        elif len(runs) < limit:
            runs.append(r)


def describe(run: Run, i: int, sample_ids: list[str], column: str, source, labels: list[str],
             tol: Tolerance) -> Finding:
    label = labels[run.source] if run.source >= 0 else ""
    matched, text = _describe(run.kind, run.sample, run.offset, label, run.first, run.last, i, sample_ids,
                              run.worst_rel, run.worst_cos, tol, run.closest)
    where = f"sample {sample_ids[i]!r}, column {column!r} source {source}"
    return Finding(sample_ids[i], column, source, run.first, run.last, run.rows, KINDS[run.kind], matched,
                   run.worst_rel, f"{where}: {text}")


def findings_of(check: SegmentCheck, i: int, sample_ids: list[str], column: str, source, labels: list[str],
                tol: Tolerance, limit: int = 20) -> list[Finding]:
    """Sample ``i``'s faulty rows in ``check`` as runs of one diagnosis (at most ``limit`` runs)."""
    runs = runs_of(check, i, sample_ids, labels, limit=limit)
    return [describe(r, i, sample_ids, column, source, labels, tol) for r in runs]


def _closest(check: SegmentCheck, i: int, p: int, sample_ids: list[str], labels: list[str], start: int = 0) -> str:
    j, q, s = int(check.match_sample[i, p]), int(check.match_position[i, p]), int(check.match_source[i, p])
    if j < 0 or check.match_rel[i, p] == float("inf"):
        return "nothing told apart from its own state"
    who = "this sample" if j == i else f"sample {sample_ids[j]!r}"
    return f"{labels[s]} at position {q + start} of {who} (relative error {float(check.match_rel[i, p]):.3g})"


def _span(first: int, last: int) -> str:
    return f"position {first}" if first == last else f"positions {first}..{last}"


def _describe(kind, j, d, label, first, last, i, ids, worst, cos, tol, closest) -> tuple[str, str]:
    span = _span(first, last)
    if kind == POSITION:
        return (f"position p{d:+d}", f"{span} match {_span(first + d, last + d)} of this sample (rows shifted by {d:+d})")
    if kind == SAMPLE:
        return (f"sample {ids[j]!r}", f"{span} match sample {ids[j]!r} at {_span(first + d, last + d)} "
                                      "(rows of another sample)")
    if kind == BOUNDARY:
        return (label, f"matches {label} instead, at {span}")
    if kind == ZERO:
        return ("zero", f"{span}: all-zero rows (padding where rows were dropped)")
    if kind == REPEAT:
        return ("repeat", f"{span}: copies of the row before (padding where rows were dropped)")
    if kind == NONFINITE:
        return ("", f"{span}: NaN/Inf values")
    assert kind == MISMATCH
    return ("", f"{span} match no recomputed state (worst relative error {worst:.3g}, limit {tol.rel:.3g}; "
                f"cosine {cos:.4f}, limit {tol.cos:.4f}; closest: {closest}): values computed from other tokens, "
                "e.g. a rejected draft branch, or by another model")
