"""Feeding the trainers people already run: speculators (vLLM's EAGLE3 trainer) and SAELens.

SpecForge's layout is written by :mod:`hsx.eagle3.export`. docs/CONSUMERS.md maps hsx's columns
to each consumer's names.
"""

from hsx.export.saelens import SaelensSummary, export_saelens, hook_name_for
from hsx.export.speculators import SpeculatorsSummary, export_speculators

__all__ = ["SaelensSummary", "SpeculatorsSummary", "export_saelens", "export_speculators", "hook_name_for"]
