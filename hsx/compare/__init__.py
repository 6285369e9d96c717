"""Comparing hidden-state rows: limits and diagnoses (``check``), tolerances by dtype (``tolerance``),
and two outputs' shared columns (``agreement``). Pure tensor code, used by recompute and replay."""
