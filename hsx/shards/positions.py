"""Which token positions a sample's rows describe: the one rule shared by writer, reader and verify.

Row j is the state after consuming token j (it predicts token j+1). An engine covers positions
``0..N-2`` (generate mode) or ``0..N-1`` (prefill mode); ``keep`` selects among them:

- ``all``: every covered position;
- ``completion``: positions whose next token is a completion token (``prompt_len-1 .. N-2``: the
  rows that produced the completion; generate mode only);
- ``loss``: positions whose next token has ``loss_mask`` 1 (what a draft head or probe learns);
- ``last``: the last covered position (one row per sample, none for a sample with no rows).

Readers (the token loader, ``ds.tokens``) may also pick rows by their own token in a vision-language
output, from its ``image_mask``: ``image`` keeps the rows whose token is an image token, ``text`` the
others. A reader's ``where`` is one rule or two joined by a comma, a position rule and a token rule
(``loss,text``): the rows both keep.

Positions are derived from a sample's own ``input_ids``, ``prompt_len`` and ``loss_mask``, so a
shard stores no position column: the rule is applied again wherever positions are needed. All
functions work on many samples at once (flat arrays, no Python loop over rows).
"""

from __future__ import annotations

import numpy as np

from hsx.errors import HsxError

KEEP = ("all", "completion", "loss", "last")
TOKEN_RULES = ("text", "image")  # readers only: the row's own token is (image) or is not (text) an image token


def check_rule(rule: str, mode: str, what: str = "--keep") -> str:
    if rule not in KEEP:
        raise HsxError(f"{what} must be one of {', '.join(KEEP)}; got {rule!r}")
    if rule == "completion" and mode == "prefill":
        raise HsxError(f"{what} completion needs generate mode: in prefill mode every token is prompt "
                       "(use loss for the assistant tokens)")
    return rule


def check_where(where: str, mode: str, has_images: bool, what: str = "where") -> str:
    """A reader's ``where``: a position rule, a token rule, or both joined by a comma (module docstring)."""
    parts = [p.strip() for p in str(where).split(",")]
    rules = [p for p in parts if p in KEEP]
    kinds = [p for p in parts if p in TOKEN_RULES]
    if len(rules) + len(kinds) != len(parts) or len(rules) > 1 or len(kinds) > 1:
        raise HsxError(f"{what} must be one of {', '.join(KEEP + TOKEN_RULES)}, or a position rule and a token rule "
                       f"joined by a comma (e.g. 'loss,text'); got {where!r}")
    if kinds and not has_images:
        raise HsxError(f"{what} {where!r}: {kinds[0]} rows need the image_mask of a vision-language output; "
                       "this output has none (every row is a text row)")
    check_rule(rules[0] if rules else "all", mode, what)
    return ",".join(rules + kinds) or "all"


def split_where(where: str) -> tuple[str, str | None]:
    """``(position rule, token rule or None)`` of a checked ``where``."""
    parts = where.split(",")
    rule = next((p for p in parts if p in KEEP), "all")
    return rule, next((p for p in parts if p in TOKEN_RULES), None)


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
           prompt_len: np.ndarray, loss_mask: np.ndarray, token_offsets: np.ndarray,
           image_mask: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask over rows ``(owner, pos)``: which of them ``rule`` keeps (a reader's ``where``
    may add a token rule, :func:`check_where`).

    ``loss_mask`` (and ``image_mask``, needed by a token rule) is the flat concatenation of the
    samples' masks, ``token_offsets`` [S+1] its sample boundaries; ``n_tokens`` and ``prompt_len``
    are per sample.
    """
    rule, kind = split_where(rule)
    keep = _select(rule, mode, owner, pos, n_tokens, prompt_len, loss_mask, token_offsets)
    if kind is None:
        return keep
    if image_mask is None:
        raise HsxError(f"the {kind} rule needs the samples' image_mask")
    at = np.asarray(token_offsets, dtype=np.int64)[owner] + pos
    is_image = np.asarray(image_mask)[at] == 1 if len(pos) else np.zeros(0, dtype=bool)
    return keep & (is_image if kind == "image" else ~is_image)


def _select(rule, mode, owner, pos, n_tokens, prompt_len, loss_mask, token_offsets) -> np.ndarray:
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
