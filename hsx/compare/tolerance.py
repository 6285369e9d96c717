"""How far a right row may be from the recompute, by stored dtype and the two compute dtypes.

A stored row differs from the recompute by three independent errors, and by the triangle
inequality its relative error is at most their sum:

- storage: rounding to the stored dtype moves each value by at most the unit roundoff u
  (bfloat16 2^-8, float16 2^-11, float32 2^-24), so a row by at most u, relative; the lossy
  dtypes by their bound below (int8 0.040, float8_e4m3 0.070);
- the engine's compute dtype and the recompute's: different kernels, batching and summation
  order round differently, and the difference grows through the blocks. These terms are
  measured (``scripts/bench_recompute.py``, docs/RECOMPUTE.md) and taken with a safety factor.

The cosine limit is the cosine of a row at the relative-error limit whose error is orthogonal to
it (``1 / sqrt(1 + rel^2)``), but no closer to 1 than a float32 cosine can resolve: the two
tests agree on noise, and the cosine, being scale-free, is the number people compare.

Two states closer than the limit cannot be told apart at these precisions: the per-row
position and layer tests ignore such an alternative. Measured, with anything tighter a bfloat16
row at a repeated token was "closer" to the same token's state a few positions back than to its
own (rounding loses exactly the small differences between such states), and a small row of a
bfloat16 recompute matched the boundary below it. Misplacements smaller than the limit are left
to the column-level layer test, which averages over every row of a column.
"""

from __future__ import annotations

import math

from hsx.compare.check import Tolerance

UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# The lossy dtypes (hsx.shards.quant) move a row by at most, relative: int8, each value by half a
# scale, a scale at most (1 + 2^-7)(1 + 2^-8) / 127 of its group's largest value, so a group of
# 64 by 8 / 2 / 127 * 1.0118 of its norm; e4m3, each value by 2^-4 of itself (plus at most 2^-10
# scales below e4m3's smallest normal). The engine hands the codec bfloat16 rows and readers get
# bfloat16 back: 2^-8 for each rounding. Measured on
# SmolLM2-135M final and eagle3 states (scripts/bench_lossy.py, docs/STORAGE.md) the worst rows
# stay well inside these bounds, which hold for any input.
UNIT_ROUNDOFF["int8"] = 4.0 / 127 * (1 + 2.0**-7) * (1 + 2.0**-8) + 2 * 2.0**-8
UNIT_ROUNDOFF["float8_e4m3"] = 2.0**-4 + 8 * 2.0**-10 / 448 * (1 + 2.0**-7) * (1 + 2.0**-8) + 2 * 2.0**-8

# Largest per-row relative error that one side computing in this dtype added against a float32
# recompute, measured with scripts/bench_recompute.py (docs/RECOMPUTE.md): bfloat16 on
# SmolLM2-135M-Instruct (30 blocks, worst row 0.114, at boundary 15; means 0.005-0.021);
# float32 measured 2.2e-6 (demo target; SmolLM2 1.8e-6), taken as 5e-6 for contexts longer
# than the ~200 tokens measured (an allowance, not a measurement). float16 was not measured: it
# keeps 3 more mantissa bits than bfloat16, so its budget is bfloat16's / 8.
MEASURED = {"float32": 5.0e-6, "bfloat16": 0.114}
MEASURED["float16"] = MEASURED["bfloat16"] / 8
SAFETY = 2.0
COS_RESOLUTION = 1e-6
# Models with recurrent layers (linear attention, short convolutions, Mamba-2): an engine decodes with the
# recurrent form, token by token, and restarts the chunked form at each prefill chunk, while the recompute
# runs the chunked form over the whole sequence; in float32 the two differ by up to 2.3e-4 per row
# (measured on the tiny Qwen3.5, Qwen3-Next, Kimi-Linear, LFM2 and Falcon-H1 of tests/families.py,
# prompts of 1-70 tokens, prefill chunks of 16, chain drafts: Qwen3-Next 2.26e-4, Qwen3.5 4.6e-5,
# Kimi-Linear 2.9e-5, Falcon-H1 7.5e-6, LFM2 2.1e-6). Added to the engine side's budget.
MEASURED_RECURRENT = 2.3e-4


def measured(dtype: str | None) -> float:
    """The measured error of one side computing in ``dtype``; an unknown dtype (e.g. ``auto``) gets bfloat16's."""
    return MEASURED.get(dtype or "", MEASURED["bfloat16"])


def tolerance_for(stored: str, engine_compute: str | None, recompute: str, rel: float | None = None,
                  recurrent: bool = False) -> Tolerance:
    """The limits for rows stored as ``stored``, computed in ``engine_compute``, recomputed in ``recompute``
    (by a model with recurrent layers when ``recurrent``); ``rel`` overrides the relative-error limit (the
    cosine limit follows it)."""
    engine = measured(engine_compute) + (MEASURED_RECURRENT if recurrent else 0.0)
    same = UNIT_ROUNDOFF[stored] + SAFETY * (engine + measured(recompute))
    if rel is None:
        rel = same
    # a float32 cosine is itself rounded to ~1e-7: no limit closer to 1 than COS_RESOLUTION
    cos = min(1.0 / math.sqrt(1.0 + rel * rel), 1.0 - COS_RESOLUTION)
    return Tolerance(rel=rel, cos=cos, same=same)
