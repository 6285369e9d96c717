"""EAGLE3 draft training from hsx shards: a torch Dataset, collation, and SpecForge's offline layout.

Alignment (row j = state after consuming token j, see docs/FORMAT.md) is kept as stored; the
one left shift EAGLE3 training needs happens in :func:`shift_for_draft`, documented in
:mod:`hsx.eagle3.dataset`.
"""

from hsx.eagle3.dataset import (
    Eagle3Dataset,
    Eagle3Layout,
    check_eagle3_layout,
    collate,
    load_draft_config,
    shift_for_draft,
)
from hsx.eagle3.export import ExportSummary, export_specforge
from hsx.eagle3.vocab import count_loss_tokens, vocab_mapping

__all__ = [
    "Eagle3Dataset",
    "Eagle3Layout",
    "ExportSummary",
    "check_eagle3_layout",
    "collate",
    "count_loss_tokens",
    "export_specforge",
    "load_draft_config",
    "shift_for_draft",
    "vocab_mapping",
]
