"""Rows of one output against the rows a fresh teacher-forced pass computed for the same tokens.

A run over an hsx output's tokens (:mod:`hsx.engine.replay.runner`) is such a pass: for every source
both outputs hold (``final``, a boundary, one part of ``eagle3``) the source output's stored rows
of a sample must be within the limit ``hsx verify --recompute`` applies to them, with the fresh
rows as the reference: ``||s - r|| / max(||r||, m)`` and the cosine, m the median norm of the
sample's fresh rows (:func:`hsx.compare.check.within_limits`). The fresh rows are rounded to
their stored dtype as well, so that rounding's bound is added to the relative limit (triangle
inequality, as in :mod:`hsx.compare.tolerance`). Pure tensor code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hsx.align import FINAL, LayerGroup
from hsx.errors import HsxError
from hsx.compare.check import Tolerance, rel_and_cos, typical_norm, within_limits
from hsx.compare.tolerance import UNIT_ROUNDOFF, tolerance_for


@dataclass(frozen=True)
class Shared:
    """One source held by both outputs: part ``part`` of the new column ``name``, part ``source_part`` of
    the source output's column ``source_name``."""

    source: int | str
    name: str
    part: int
    source_name: str
    source_part: int

    @property
    def label(self) -> str:
        return f"column {self.source_name!r}" + ("" if self.source == FINAL else f" (boundary {self.source})")


def shared_sources(groups: Sequence[LayerGroup], source_layers: Sequence[dict], where: str) -> list[Shared]:
    """The sources both outputs hold, in the new columns' order. A column name both outputs use for
    different sources is refused (the new ``eagle3`` would mean something else than the source's)."""
    held: dict[int | str, tuple[str, int]] = {}
    by_name = {g["name"]: list(g["sources"]) for g in source_layers}
    for g in source_layers:
        for k, s in enumerate(g["sources"]):
            held.setdefault(s, (g["name"], k))
    for g in groups:
        if g.name in by_name and list(g.sources) != by_name[g.name]:
            hint = "; give --eagle3-layer-ids for the source's" if g.name == "eagle3" else ""
            raise HsxError(f"column {g.name!r} would hold sources {list(g.sources)}, but in {where} it holds "
                           f"{by_name[g.name]}{hint}")
    return [Shared(s, g.name, k, *held[s]) for g in groups for k, s in enumerate(g.sources) if s in held]


def agreement_tolerance(source_meta: dict, compute: str | None, stored: str) -> Tolerance:
    """The limit for the source's rows against fresh rows computed in ``compute`` and rounded to ``stored``."""
    engine = (source_meta.get("engine") or {}).get("compute_dtype")
    base = tolerance_for(source_meta["dtype"], engine, compute)
    return tolerance_for(source_meta["dtype"], engine, compute, rel=base.rel + UNIT_ROUNDOFF[stored])


def disagreement(stored: torch.Tensor, fresh: torch.Tensor, tol: Tolerance) -> tuple[int, int, float] | None:
    """``stored`` and ``fresh`` ``[R, H]`` rows of one source of one sample: None when every stored row is
    within ``tol`` of its fresh row (or there are none), else (rows beyond it, the worst row, its relative error)."""
    if stored.shape[0] == 0:
        return None
    s, r = stored.float()[None], fresh.float()[None]  # [1, R, H]
    floor = typical_norm(r, torch.ones(r.shape[:2], dtype=torch.bool))  # [1, 1]
    rel, cos = rel_and_cos(s, r, floor)
    bad = ~(torch.isfinite(s).all(-1) & within_limits(rel, cos, r, floor, tol))[0]  # [R]
    if not bool(bad.any()):
        return None
    rel = rel[0].nan_to_num(nan=float("inf")).masked_fill(~bad, -1.0)
    worst = int(rel.argmax())
    return int(bad.sum()), worst, float(rel[worst])
