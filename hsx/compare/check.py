"""Stored rows against recomputed states: per-row errors, the position and layer tests, diagnoses.

Pure tensor code, one batch at a time. A "segment" is one source of one column (``eagle3`` has
three, side by side along the width). For every stored row s at position p of sample i:

- own error: relative error ``||s - r|| / max(||r||, m)`` (m: the median row norm of the
  sample's recomputed states of that source) and cosine against the recomputed state r of its
  own source at (i, p); both must be within the tolerance;
- position test: the best match of s over every other position of every sample in the batch
  (p-1 and p+1 among them), own source;
- layer test: s against the neighbouring sources at (i, p): boundaries b-1 and b+1, and the
  other side of the final norm.

A row whose best alternative is closer than ``margin`` times its own error is misplaced even
when its own error is within tolerance. An alternative within ``same`` of the row's own state
cannot be told apart from it at these precisions (the same state computed twice, as in a prefix
two samples share; or states that rounding blurs together) and never counts. Misplacements
finer than that are left to the column-level layer test (``results.SourceResult.finish``),
which averages over every row of a column.

Faulty rows are then diagnosed: non-finite, all zero, copies of the row before (padding), the
alternative they match (another position, another sample, another layer), or "mismatch" when
nothing recomputed here is within the tolerance (values computed from other tokens, such as a
rejected draft branch, or by another model).

Cost: the position test is one ``[T, B*T]`` matmul per sample and segment, ~``B * T * H`` flops
per row: small next to the forward of a real model (~2 x parameters flops per token); on the
tiny demo model (hidden 128) the two take about as long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

KINDS = ("ok", "nonfinite", "zero", "repeat", "position", "sample", "boundary", "mismatch")
OK, NONFINITE, ZERO, REPEAT, POSITION, SAMPLE, BOUNDARY, MISMATCH = range(len(KINDS))
_TINY = 1e-30
_SEARCH_BLOCK = 1 << 24  # entries of one distance block: 64 MB in float32
@dataclass(frozen=True)
class Tolerance:
    """Per-row limits: relative error at most ``rel``, cosine at least ``cos``."""

    rel: float
    cos: float
    # states closer than this (relative) cannot be told apart at the shards' precision (one state
    # computed twice, e.g. a prefix two samples share, or states rounding blurs together): a
    # row matching such an alternative is not misplaced
    same: float = 0.0
    margin: float = 0.5  # an alternative this much closer than the row's own state wins

    def describe(self) -> dict:
        return {"rel": self.rel, "cos": self.cos, "same": self.same, "margin": self.margin}


@dataclass
class SegmentCheck:
    """Results for one segment of a batch; every tensor is ``[B, T]`` (T = the longest sequence)."""

    valid: torch.Tensor  # bool: a stored row exists at (i, p)
    rel: torch.Tensor  # own relative error (0 where not valid)
    cos: torch.Tensor  # own cosine (1 where not valid)
    kind: torch.Tensor  # int64 code into KINDS, OK where valid and right
    match_sample: torch.Tensor  # batch index of the best match (-1: none)
    match_position: torch.Tensor
    match_source: torch.Tensor  # index into the sources [own, *alternatives] (-1: none)
    match_rel: torch.Tensor  # relative error against the best match (inf: none)
    layer_rel: list[torch.Tensor]  # per alternative source: relative error of every row against it (inf: none)


def rel_and_cos(s: torch.Tensor, r: torch.Tensor, floor=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., H]`` x ``[..., H]`` -> relative error ``||s - r|| / max(||r||, floor)`` and cosine, each ``[...]``."""
    r_norm = r.norm(dim=-1)
    rel = _rel(s, r, floor)
    cos = (s * r).sum(-1) / (s.norm(dim=-1) * r_norm).clamp_min(_TINY)
    return rel, cos


def _rel(s: torch.Tensor, r: torch.Tensor, floor=0.0) -> torch.Tensor:
    return (s - r).norm(dim=-1) / torch.maximum(r.norm(dim=-1), torch.as_tensor(floor, device=r.device)).clamp_min(_TINY)


def typical_norm(own: torch.Tensor, ref_valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the median row norm of each sample's states. Rounding noise scales with the
    residual stream's typical magnitude, not with one small row: the demo target's worst
    bfloat16 row, with a quarter of the median norm, measured 0.30 relative to its own norm and
    0.12 relative to the median (docs/RECOMPUTE.md), so errors are taken relative to
    ``max(||r||, median)``."""
    norms = own.norm(dim=-1).masked_fill(~ref_valid, float("nan"))  # [B, T]
    return norms.nanmedian(dim=1).values.nan_to_num(nan=0.0)[:, None]


def within_limits(rel: torch.Tensor, cos: torch.Tensor, own: torch.Tensor, floor: torch.Tensor,
                  tol: Tolerance) -> torch.Tensor:
    """``[...]`` bool: the own error of each row within ``tol``, for rows checked against ``own [..., H]``
    with ``floor`` their :func:`typical_norm`. A row smaller than the median may have the same
    absolute error, hence a wider angle: its cosine limit widens by the same factor."""
    widen = (floor / own.norm(dim=-1).clamp_min(_TINY)).clamp_min(1.0)
    cos_limit = torch.minimum(1.0 / torch.sqrt(1.0 + (tol.rel * widen) ** 2), torch.tensor(tol.cos, device=own.device))
    return (rel <= tol.rel) & (cos >= cos_limit)


def _nearest_elsewhere(stored: torch.Tensor, own: torch.Tensor, ref_valid: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """For each row of ``stored [B, T, H]`` the flat index (sample * T + position) ``[B, T]`` of the
    closest state of ``own`` at any other valid (sample, position), by relative error."""
    batch, width, _ = own.shape
    flat = own.reshape(batch * width, -1)  # [B*T, H]
    r_sq = (flat * flat).sum(-1)  # [B*T]
    blocked = ~ref_valid.reshape(-1)
    best = torch.zeros(batch, width, dtype=torch.long, device=own.device)
    step = max(1, _SEARCH_BLOCK // (batch * width))
    for i in range(batch):
        for a in range(0, width, step):
            s = torch.nan_to_num(stored[i, a:a + step])  # [t, H]
            # ||s - r||^2 = ||s||^2 + ||r||^2 - 2 s.r as one matmul; it loses digits near zero, so
            # the caller recomputes the winner's error exactly
            d_sq = (s * s).sum(-1)[:, None] + r_sq[None, :] - 2 * s @ flat.T  # [t, B*T]
            d_sq = d_sq.clamp_min(0) / r_sq.clamp_min(float(floor[i]) ** 2).clamp_min(_TINY)[None, :]
            d_sq[:, blocked] = float("inf")
            rows = torch.arange(a, a + s.shape[0], device=own.device)
            d_sq[rows - a, i * width + rows] = float("inf")  # its own position is not an alternative
            best[i, a:a + s.shape[0]] = d_sq.argmin(1)
    return best


def check_segment(
    stored: torch.Tensor,
    valid: torch.Tensor,
    own: torch.Tensor,
    alts: Sequence[torch.Tensor],
    n_tokens: torch.Tensor,
    tol: Tolerance,
) -> SegmentCheck:
    """Check ``stored [B, T, H]`` (rows where ``valid [B, T]``) against ``own [B, T, H]``, the recomputed
    states of its source, with ``alts`` the neighbouring sources' states; ``n_tokens [B]`` bounds
    the positions that exist."""
    batch, width = valid.shape
    dev = stored.device
    ref_valid = torch.arange(width, device=dev)[None, :] < n_tokens.to(dev)[:, None]  # [B, T]
    valid = valid & ref_valid
    floor = typical_norm(own, ref_valid)  # [B, 1]
    rel, cos = rel_and_cos(stored, own, floor)
    finite = torch.isfinite(stored).all(-1)
    rel = torch.where(valid, rel, torch.zeros_like(rel))
    cos = torch.where(valid, cos, torch.ones_like(cos))
    inf = torch.full((batch, width), float("inf"), device=dev)

    # position test: the nearest other state of the same source, kept only if it is a different state
    flat = _nearest_elsewhere(stored, own, ref_valid, floor)
    best_sample, best_pos = flat // width, flat % width
    other = own[best_sample, best_pos]  # [B, T, H]
    distinct = _rel(other, own, floor) > tol.same
    best_rel = torch.where(distinct & valid, _rel(stored, other, floor), inf)
    best_src = torch.zeros_like(best_sample)
    del other
    # layer test: the neighbouring sources at the row's own position
    rows = torch.arange(batch, device=dev)[:, None].expand(batch, width)
    pos = torch.arange(width, device=dev)[None, :].expand(batch, width)
    layer_rel = []
    for a, r in enumerate(alts, start=1):
        layer_rel.append(torch.where(valid, _rel(stored, r, floor), inf))
        a_rel = torch.where(_rel(r, own, floor) > tol.same, layer_rel[-1], inf)
        better = a_rel < best_rel
        best_rel = torch.where(better, a_rel, best_rel)
        best_sample, best_pos = torch.where(better, rows, best_sample), torch.where(better, pos, best_pos)
        best_src = torch.where(better, torch.full_like(best_src, a), best_src)

    within = within_limits(rel, cos, own, floor, tol)
    misplaced = best_rel < tol.margin * rel
    bad = valid & ~(finite & within & ~misplaced)
    kind = torch.zeros((batch, width), dtype=torch.long, device=dev)
    match = [best_sample, best_pos, best_src, best_rel]
    if bool(bad.any()):
        _diagnose(stored, own, alts, ref_valid, valid, finite, rel, bad, kind, match, tol, floor, layer_rel)
    none = kind == OK
    for m, fill in zip(match, (-1, -1, -1, float("inf"))):
        m.masked_fill_(none, fill)
    return SegmentCheck(valid, rel, cos, kind, *match, layer_rel)


def _diagnose(stored, own, alts, ref_valid, valid, finite, rel, bad, kind, match, tol, floor, layer_rel) -> None:
    """Fill ``kind`` (in place) for the rows where ``bad``; may move matches to the sample's one story."""
    batch, width = bad.shape
    best_sample, best_pos, best_src, best_rel = match
    found = (best_rel <= tol.rel) | (best_rel < tol.margin * rel)
    rows = torch.arange(batch, device=kind.device)[:, None]
    kind[bad] = MISMATCH
    kind[bad & found & (best_src != 0)] = BOUNDARY
    kind[bad & found & (best_src == 0) & (best_sample != rows)] = SAMPLE
    kind[bad & found & (best_src == 0) & (best_sample == rows)] = POSITION
    # A row already outside the limit that a neighbouring source explains belongs to that source,
    # even when the two sources' states are too close for the per-row test to count it.
    for a, a_rel in enumerate(layer_rel, start=1):
        take = bad & (kind == MISMATCH) & (a_rel <= tol.rel) & (a_rel < tol.margin * rel)
        kind[take], best_src[take], best_rel[take] = BOUNDARY, a, a_rel[take]
        best_sample[take], best_pos[take] = rows.expand_as(take)[take], torch.arange(width, device=kind.device).expand_as(take)[take]
    # Padding repeats the row before it. So does a shifted or swapped boundary-0 column wherever
    # a token repeats; there the copy also fits the placement that explains the sample's other
    # rows. A copy is padding unless that story explains it and at least as many rows that are not copies.
    story = torch.zeros_like(bad)
    for row in range(batch):
        story[row] = _prefer_one_story(row, stored, own, alts, ref_valid, kind, match, tol, floor[row])
    # the row before is the previous stored one (under --keep, not always position p-1); a copy
    # where the two positions have one state (a repeated token at boundary 0) is no padding
    prev = _previous_stored(valid)  # [B, T], -1: none
    at = prev.clamp_min(0)[..., None].expand_as(stored)
    prev_same = ((stored == stored.gather(1, at)).all(-1) & (prev >= 0)
                 & (_rel(own, own.gather(1, at), floor) > tol.same))
    copy = prev_same & bad
    explained = story & ((story & ~copy).sum(1) >= copy.sum(1))[:, None]
    kind[copy & ~explained] = REPEAT
    kind[bad & (stored.norm(dim=-1) == 0)] = ZERO
    kind[bad & ~finite] = NONFINITE


def _previous_stored(valid: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the position of the stored row before each position (-1 where there is none)."""
    pos = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    last = torch.where(valid, pos, torch.full_like(pos, -1)).cummax(dim=1).values  # [B, T] latest stored at or before p
    prev = torch.full_like(last, -1)
    prev[:, 1:] = last[:, :-1]
    return prev


def _placed_kind(sample: int, row: int, source: int) -> int:
    return BOUNDARY if source != 0 else (POSITION if sample == row else SAMPLE)


def _prefer_one_story(i, stored, own, alts, ref_valid, kind, match, tol, floor) -> torch.Tensor:
    """Re-explain sample ``i``'s misplaced rows by its most common misplacement where that fits as well;
    returns the rows it explains ``[T]``.

    Ties are real: at boundary 0 a repeated token has one state at several positions, so a row
    shifted by +1 may match p-1 just as well. One fault that explains every row is the diagnosis.
    """
    best_sample, best_pos, best_src, best_rel = match
    width = kind.shape[1]
    fits = torch.zeros(width, dtype=torch.bool, device=kind.device)
    placed = ((kind[i] == POSITION) | (kind[i] == SAMPLE) | (kind[i] == BOUNDARY)).nonzero()[:, 0]  # [F]
    if placed.numel() == 0:
        return fits
    keys = torch.stack([best_sample[i, placed], best_pos[i, placed] - placed, best_src[i, placed]], 1)  # [F, 3]
    uniq, counts = keys.unique(dim=0, return_counts=True)
    j, d, s = uniq[counts.argmax()].tolist()
    q = placed + d
    exists = (q >= 0) & (q < width)
    q = q.clamp(0, width - 1)
    exists &= ref_valid[j, q]
    rel = _rel(stored[i, placed], (own if s == 0 else alts[s - 1])[j, q], floor)
    take = exists & (rel <= best_rel[i, placed] + tol.same)
    p = placed[take]
    best_sample[i, p], best_pos[i, p], best_src[i, p], best_rel[i, p] = j, q[take], s, rel[take]
    kind[i, p] = _placed_kind(j, i, s)
    fits[p] = True
    return fits
