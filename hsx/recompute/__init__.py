"""Recompute check: stored rows against an independent teacher-forced forward of the same model."""

from hsx.compare.check import KINDS, Tolerance, check_segment
from hsx.recompute.reference import Reference
from hsx.recompute.results import Finding, RecomputeReport, SampleResult, SourceResult
from hsx.recompute.run import AUTO_CHUNK, check_samples, chunk_for, recompute, resolve_chunk
from hsx.compare.tolerance import tolerance_for

__all__ = [
    "AUTO_CHUNK", "KINDS", "Tolerance", "check_segment", "Reference", "Finding", "RecomputeReport", "SampleResult",
    "SourceResult", "check_samples", "chunk_for", "recompute", "resolve_chunk", "tolerance_for",
]
