"""How far a right row may be from the recompute, by stored dtype and the two compute dtypes.

A stored row differs from the recompute by three independent errors, and by the triangle
inequality its relative error is at most their sum:

- storage: rounding to the stored dtype moves each value by at most the unit roundoff u
  (bfloat16 2^-8, float16 2^-11, float32 2^-24), so a row by at most u, relative;
- the engine's compute dtype and the recompute's: different kernels, batching and summation
  order round differently, and the difference grows through the blocks. These terms are
  measured (``scripts/bench_recompute.py``, docs/RECOMPUTE.md) and taken with a safety factor.

The cosine limit is the cosine of a row at the relative-error limit whose error is orthogonal to
it (``1 / sqrt(1 + rel^2)``), but no closer to 1 than a float32 cosine can resolve: the two
tests agree on noise, and the cosine, being scale-free, is the number people compare.

Two recomputed states closer than the stored rounding plus the recompute's own budget are one
state computed twice (the shared prefix of two samples, a repeated token at boundary 0): the
position test does not count a row that matches the other copy.
"""

from __future__ import annotations

import math

from hsx.recompute.compare import Tolerance

UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}

# Largest per-row relative error one side computing in this dtype added, measured against a
# float32 recompute on the models in docs/RECOMPUTE.md, times SAFETY.
MEASURED = {"float32": 2.0e-6, "float16": 3.0e-3, "bfloat16": 2.4e-2}
SAFETY = 4.0
COS_RESOLUTION = 1e-6


def compute_term(dtype: str | None) -> float:
    """The budget for one side computing in ``dtype``; an unknown dtype (e.g. ``auto``) gets bfloat16's."""
    return SAFETY * MEASURED.get(dtype or "", MEASURED["bfloat16"])


def tolerance_for(stored: str, engine_compute: str | None, recompute: str, rel: float | None = None) -> Tolerance:
    """The limits for rows stored as ``stored``, computed in ``engine_compute``, recomputed in ``recompute``;
    ``rel`` overrides the relative-error limit (the cosine limit follows it)."""
    if rel is None:
        rel = UNIT_ROUNDOFF[stored] + compute_term(engine_compute) + compute_term(recompute)
    # a float32 cosine is itself rounded to ~1e-7: no limit closer to 1 than COS_RESOLUTION
    cos = min(1.0 / math.sqrt(1.0 + rel * rel), 1.0 - COS_RESOLUTION)
    return Tolerance(rel=rel, cos=cos, same=UNIT_ROUNDOFF[stored] + compute_term(recompute))
