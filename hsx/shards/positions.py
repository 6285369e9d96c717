"""Which token positions a sample's rows describe: the one rule shared by writer, reader and verify.

Row j is the state after consuming token j (it predicts token j+1). An engine covers positions
``0..N-2`` (generate mode) or ``0..N-1`` (prefill mode); ``keep`` selects among them:

- ``all``: every covered position;
- ``completion``: positions whose next token is a completion token (``prompt_len-1 .. N-2``: the
  rows that produced the completion; generate mode only);
- ``loss``: positions whose next token has ``loss_mask`` 1 (what a draft head or probe learns);
- ``last``: the last covered position (one row per sample, none for a sample with no rows).

Positions are derived from a sample's own ``input_ids``, ``prompt_len`` and ``loss_mask``, so a
shard stores no position column: the rule is applied again wherever positions are needed. All
functions work on many samples at once (flat arrays, no Python loop over rows).
"""

from __future__ import annotations

import numpy as np

from hsx.errors import HsxError

KEEP = ("all", "completion", "loss", "last")


def check_rule(rule: str, mode: str, what: str = "--keep") -> str:
    if rule not in KEEP:
        raise HsxError(f"{what} must be one of {', '.join(KEEP)}; got {rule!r}")
    if rule == "completion" and mode == "prefill":
        raise HsxError(f"{what} completion needs generate mode: in prefill mode every token is prompt "
                       "(use loss for the assistant tokens)")
    return rule


def covered_rows(n_tokens: np.ndarray, mode: str) -> np.ndarray:
    """Rows the engine produces for samples of ``n_tokens`` tokens (before ``keep``)."""
    if mode == "generate":
        return np.maximum(n_tokens - 1, 0)
    if mode == "prefill":
        return np.asarray(n_tokens)
    raise HsxError(f"unknown mode {mode!r}; expected generate or prefill")


def candidates(n_tokens: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(owner, position) of every covered row, samples in order, positions ascending."""
    rows = covered_rows(np.asarray(n_tokens, dtype=np.int64), mode)
    owner = np.repeat(np.arange(len(rows)), rows)
    first = np.repeat(np.cumsum(rows) - rows, rows)
    return owner, np.arange(int(rows.sum()), dtype=np.int64) - first


def select(rule: str, mode: str, owner: np.ndarray, pos: np.ndarray, n_tokens: np.ndarray,
           prompt_len: np.ndarray, loss_mask: np.ndarray, token_offsets: np.ndarray) -> np.ndarray:
    """Boolean mask over rows ``(owner, pos)``: which of them ``rule`` keeps.

    ``loss_mask`` is the flat concatenation of the samples' masks, ``token_offsets`` [S+1] its
    sample boundaries; ``n_tokens`` and ``prompt_len`` are per sample.
    """
    n = np.asarray(n_tokens, dtype=np.int64)[owner]
    if rule == "all":
        return np.ones(len(pos), dtype=bool)
    has_next = pos + 1 < n
    if rule == "completion":
        return has_next & (pos + 1 >= np.asarray(prompt_len, dtype=np.int64)[owner])
    if rule == "loss":
        nxt = np.asarray(token_offsets, dtype=np.int64)[owner] + np.minimum(pos + 1, n - 1)
        return has_next & (np.asarray(loss_mask)[nxt] == 1) if len(pos) else has_next
    if rule == "last":
        return pos == covered_rows(n, mode) - 1
    raise HsxError(f"unknown position rule {rule!r}; expected one of {KEEP}")


def kept(keep: str, mode: str, n_tokens: np.ndarray, prompt_len: np.ndarray, loss_mask: np.ndarray,
         token_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, position) of the rows a shard stores under ``keep``, in storage order."""
    owner, pos = candidates(n_tokens, mode)
    if keep == "all":
        return owner, pos
    m = select(keep, mode, owner, pos, n_tokens, prompt_len, loss_mask, token_offsets)
    return owner[m], pos[m]


def stored_rows(keep: str, mode: str, n_tokens, prompt_len, loss_mask, token_offsets) -> np.ndarray:
    """Rows per sample under ``keep`` [S]."""
    owner, _ = kept(keep, mode, n_tokens, prompt_len, loss_mask, token_offsets)
    return np.bincount(owner, minlength=len(n_tokens)).astype(np.int64)


def sample_positions(keep: str, mode: str, n_tokens: int, prompt_len: int, loss_mask: np.ndarray) -> np.ndarray:
    """Positions of one sample's stored rows."""
    _, pos = kept(keep, mode, np.array([n_tokens]), np.array([prompt_len]), np.asarray(loss_mask),
                  np.array([0, n_tokens]))
    return pos
