"""Prompts of different lengths as one padded batch, prefilled whole or in chunks."""

from __future__ import annotations

from typing import Sequence

import torch


def pad_prompts(prompts: Sequence[torch.Tensor], side: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, P]`` and ``valid [B, P]`` for prompts of different lengths."""
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        cols = slice(0, p.numel()) if side == "right" else slice(width - p.numel(), width)
        ids[i, cols] = p
        valid[i, cols] = True
    return ids.to(device), valid.to(device)


def prompt_tokens_in(prompts: Sequence[torch.Tensor], side: str, part: slice) -> int:
    """Real (not padding) prompt tokens in the slots ``part`` of :func:`pad_prompts`' layout, counted
    on the host."""
    lengths = torch.tensor([p.numel() for p in prompts])  # [B]
    width = int(lengths.max())
    start = torch.zeros_like(lengths) if side == "right" else width - lengths
    return int((torch.clamp(start + lengths, max=part.stop) - torch.clamp(start, min=part.start)).clamp(min=0).sum())


def prompt_positions(valid: torch.Tensor) -> torch.Tensor:
    """Positions ``[B, P]`` of a padded prompt, counted over real tokens only."""
    return (valid.long().cumsum(1) - 1).clamp(min=0)


def prompt_block(valid: torch.Tensor, part: slice) -> torch.Tensor:
    """Causal visibility ``[B, q, q]`` among the prompt slots ``part`` (q of them), padding hidden; the slots
    before ``part`` are the cache's committed ones, all earlier and all visible."""
    width = part.stop - part.start
    causal = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
    return causal[None] & valid[:, None, part]


def prompt_chunks(width: int, size: int | None) -> list[slice]:
    """The prompt slots ``0..width-1`` in consecutive parts of ``size`` (None: one part)."""
    size = width if size is None else size
    return [slice(start, min(start + size, width)) for start in range(0, width, size)]


class PromptRows:
    """Each request's prompt rows, appended part by part with its padding left out, in the stored dtype."""

    def __init__(self, batch: int, dtype: torch.dtype):
        self.dtype = dtype
        self.parts: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(batch)]

    def add(self, cols: dict[str, torch.Tensor], valid: torch.Tensor) -> None:
        """``cols``: name -> ``[B, q, W]`` of one part; ``valid [B, q]``: its real tokens."""
        for name, c in cols.items():
            for i, parts in enumerate(self.parts):
                parts.setdefault(name, []).append(c[i][valid[i]].to(self.dtype))  # a copy: the part's tensor can go

    def of(self, i: int) -> dict[str, torch.Tensor]:
        return {name: p[0] if len(p) == 1 else torch.cat(p) for name, p in self.parts[i].items()}
