"""EAGLE3 draft training from hsx shards or a live run: torch datasets, collation, the draft vocabulary.

SpecForge's offline layout is written by :mod:`hsx.export.specforge`.

Alignment (row j = state after consuming token j, see docs/FORMAT.md) is kept as stored; the
one left shift EAGLE3 training needs happens in :func:`shift_for_draft`, documented in
:mod:`hsx.eagle3.dataset`.
"""

from hsx.eagle3.dataset import (
    Eagle3Dataset,
    Eagle3Layout,
    check_eagle3_layout,
    collate,
    eagle3_sample,
    load_draft_config,
    shift_for_draft,
)
from hsx.eagle3.online import Eagle3Stream
from hsx.eagle3.vocab import count_loss_tokens, vocab_mapping

__all__ = [
    "Eagle3Dataset",
    "Eagle3Layout",
    "Eagle3Stream",
    "check_eagle3_layout",
    "collate",
    "count_loss_tokens",
    "eagle3_sample",
    "load_draft_config",
    "shift_for_draft",
    "vocab_mapping",
]
