"""How an engine cuts a window of prompts into forwards: longest first, within a row and a token budget.

Pure functions over prompt lengths, shared by the engines' runners. A window is sorted once
(longest first, ties in window order), so sequences of like length share a forward and padding
is small; the longest batches come first, so a budget that does not fit fails early.
"""

from __future__ import annotations

from typing import Sequence


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Indices of ``lengths`` from the longest to the shortest; equal lengths keep their order."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def prefill_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` cut into forwards, longest first: at most ``max_rows`` sequences each,
    and at most ``max_tokens`` padded tokens (rows x longest) unless a sequence alone is longer."""
    if max_rows < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"max_rows {max_rows} and max_tokens {max_tokens} must be >= 1")
    batches: list[list[int]] = []
    for i in longest_first(lengths):
        last = batches[-1] if batches else None
        # sorted longest first: the batch's first sequence sets its padded width
        if last and len(last) < max_rows and (max_tokens is None or (len(last) + 1) * lengths[last[0]] <= max_tokens):
            last.append(i)
        else:
            batches.append([i])
    return batches
