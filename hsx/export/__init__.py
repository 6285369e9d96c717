"""Feeding the trainers people already run: SpecForge's offline layout, speculators (vLLM's EAGLE3
trainer) and SAELens' cached activations. docs/CONSUMERS.md maps hsx's columns to each consumer's names.
"""

from hsx.export.saelens import SaelensSummary, export_saelens, hook_name_for
from hsx.export.specforge import ExportSummary, export_specforge
from hsx.export.speculators import SpeculatorsSummary, export_speculators

__all__ = ["ExportSummary", "SaelensSummary", "SpeculatorsSummary", "export_saelens", "export_specforge", "export_speculators",
           "hook_name_for"]
