"""Recompute check: stored rows against an independent teacher-forced forward of the same model."""

from hsx.recompute.compare import KINDS, Tolerance, check_segment
from hsx.recompute.reference import Reference
from hsx.recompute.results import Finding, RecomputeReport, SampleResult, SourceResult
from hsx.recompute.run import check_samples, recompute
from hsx.recompute.tolerance import tolerance_for

__all__ = [
    "KINDS", "Tolerance", "check_segment", "Reference", "Finding", "RecomputeReport", "SampleResult",
    "SourceResult", "check_samples", "recompute", "tolerance_for",
]
