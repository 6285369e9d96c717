"""The draft vocabulary of an EAGLE3 head: the most frequent learned tokens, as d2t / t2d.

Same definition as SpecForge 0.2.0 (``generate_vocab_mapping_file`` and
``process_token_dict_to_mappings`` in specforge/data/preprocessing.py):

- count every token whose loss_mask is 1;
- keep the ``draft_vocab_size`` most frequent; when fewer distinct tokens were seen, fill up
  with the smallest ids not yet kept (frequency 0);
- sort the kept ids: ``d2t[i] = kept[i] - i`` (int64 offsets, so ``draft id + d2t[draft id]``
  is the target id) and ``t2d[v] = v is kept`` (bool over the target vocabulary).

Ties at the cut are broken by the smaller token id. SpecForge breaks them by the order in which
tokens were first met in its (shuffled) dataset, so only the tie order can differ.
"""

from __future__ import annotations

from typing import Iterable

import torch

from hsx.errors import HsxError


def count_loss_tokens(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Counts ``[vocab_size]`` int64 of the tokens whose loss_mask is 1, over (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in pairs:
        learned = ids[mask.bool()].to(torch.int64)
        if learned.numel() and (int(learned.min()) < 0 or int(learned.max()) >= vocab_size):
            raise HsxError(f"token ids {int(learned.min())}..{int(learned.max())} fall outside a vocabulary of {vocab_size}")
        counts += torch.bincount(learned, minlength=vocab_size)
    return counts


def vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [draft_vocab_size] int64, t2d [len(counts)] bool)`` from per-token counts."""
    vocab_size = len(counts)
    if not 1 <= draft_vocab_size <= vocab_size:
        raise HsxError(f"draft vocab size must be in 1..{vocab_size} (the target vocabulary), got {draft_vocab_size}")
    ids = torch.arange(vocab_size)
    seen = ids[counts > 0]
    # stable sort by descending count keeps ascending ids among equal counts
    order = torch.sort(-counts[seen], stable=True).indices
    kept = seen[order][:draft_vocab_size]
    if len(kept) < draft_vocab_size:
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[kept] = False
        kept = torch.cat([kept, ids[unused][: draft_vocab_size - len(kept)]])
    kept = torch.sort(kept).values
    d2t = (kept - torch.arange(draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
