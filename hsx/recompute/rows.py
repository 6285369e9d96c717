"""Where a sample's stored rows are: their positions, their count, and reading all or some of them.

A sample is a shard ``Sample`` (rows read from its shard when asked for, ``rows=slice(a, b)`` for
part of them) or an engine's ``AlignedSample`` (rows already in memory, a mapping of tensors).
"""

from __future__ import annotations

from typing import Mapping

import torch

from hsx.recompute.results import Finding

EXPECTED_ROWS = {"generate": lambda n: max(n - 1, 0), "prefill": lambda n: n}


def sample_id(sample, index: int) -> str:
    return str(getattr(sample, "sample_id", None) or f"#{index}")


def token_ids(sample) -> torch.Tensor:
    return torch.as_tensor(sample.input_ids).reshape(-1).long()  # [N]


def positions(sample, mode: str) -> torch.Tensor:
    """Token positions of a sample's stored rows, in row order: a shard sample's own (its ``--keep``
    rule), else every position the mode covers."""
    pos = getattr(sample, "positions", None)
    if pos is not None:
        return torch.as_tensor(pos).long()
    return torch.arange(EXPECTED_ROWS[mode](torch.as_tensor(sample.input_ids).numel()))


def num_rows(sample, name: str) -> int:
    """Stored rows of column ``name``, read from the shard's row counts where it has them (no rows decoded)."""
    h = sample.hidden
    if isinstance(h, Mapping):
        return int(h[name].shape[0])
    return int(sample.num_rows)


def hidden(sample, name: str, rows: slice | None = None) -> torch.Tensor:
    """Column ``name``'s rows (``rows``: only those, a shard sample reading nothing else)."""
    h = sample.hidden
    if isinstance(h, Mapping):
        return h[name] if rows is None else h[name][rows]
    return h(name) if rows is None else h(name, rows=rows)


def count_finding(sid: str, column: str, got: int, want: int, n_tokens: int, mode: str) -> Finding | None:
    """A finding when a sample has another number of rows than its tokens, mode and keep rule give."""
    if got == want:
        return None
    return Finding(sid, column, "", 0, max(got, want) - 1, abs(got - want), "count", "", float("inf"),
                   f"sample {sid!r}: {got} rows for {n_tokens} tokens, {mode} mode and the keep rule give {want}")
