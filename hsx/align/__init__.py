"""Alignment core: pure tensor code shared by every engine (no engine imports here)."""

from hsx.align.layers import EAGLE3, FINAL, LayerGroup, ModelShape, needed_sources, parse_layers
from hsx.align.rows import AlignedSample, Collector, accepted_mask, slice_verify_step, teacher_forced

__all__ = [
    "EAGLE3", "FINAL", "LayerGroup", "ModelShape", "needed_sources", "parse_layers",
    "AlignedSample", "Collector", "accepted_mask", "slice_verify_step", "teacher_forced",
]
