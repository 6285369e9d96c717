"""Draft trees of the embedded engine's speculative steps, one per request, batched."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Draft trees, one per request, root (the last emitted token) at node 0, parents before children."""

    tokens: torch.Tensor  # [B, n]
    parents: torch.Tensor  # [B, n] node index; the root is its own parent
    depth: torch.Tensor  # [B, n]
    anc: torch.Tensor  # [B, n, n] bool: anc[b, i, j] = j is i or an ancestor of i
    score: torch.Tensor  # [B, n] cumulative draft log-prob (0 at the root)

    @staticmethod
    def start(root: torch.Tensor, size: int) -> "DraftTree":
        """Room for ``size`` nodes, filled by :meth:`add`; ``size == 1`` is plain decoding's tree."""
        batch, dev = root.shape[0], root.device
        zeros = torch.zeros(batch, size, dtype=torch.long, device=dev)
        tree = DraftTree(zeros.clone(), zeros.clone(), zeros.clone(),
                     torch.zeros(batch, size, size, dtype=torch.bool, device=dev), zeros.float())
        tree.tokens[:, 0], tree.anc[:, 0, 0] = root, True
        return tree

    def add(self, start: int, tokens, scores, parents, level: int) -> torch.Tensor:
        """Fill nodes ``start, start + 1, ...`` with children of ``parents [B, c]``; returns their indices."""
        idx = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        self.tokens[:, idx], self.score[:, idx], self.parents[:, idx], self.depth[:, idx] = tokens, scores, parents, level
        self.anc[:, idx] = self.anc.gather(1, parents[:, :, None].expand(-1, -1, self.anc.shape[2]))
        self.anc[:, idx, idx] = True
        return idx

    def visibility(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[B, q, k]``: which of the nodes ``keys [B, k]`` each node of ``queries [B, q]`` descends from (or is)."""
        rows = self.anc.gather(1, queries[:, :, None].expand(-1, -1, self.anc.shape[2]))  # [B, q, M]
        return rows.gather(2, keys[:, None, :].expand(-1, queries.shape[1], -1))

    def subtree(self, nodes: torch.Tensor) -> "DraftTree":
        """The nodes ``[B, n]`` (ancestor-closed, root first), renumbered 0..n-1."""
        batch, n = nodes.shape
        slot_of = torch.full(self.tokens.shape, -1, dtype=torch.long, device=nodes.device)
        slot_of.scatter_(1, nodes, torch.arange(n, device=nodes.device).expand(batch, n))
        return DraftTree(
            self.tokens.gather(1, nodes),
            slot_of.gather(1, self.parents.gather(1, nodes)),
            self.depth.gather(1, nodes),
            self.visibility(nodes, nodes),
            self.score.gather(1, nodes),
        )
