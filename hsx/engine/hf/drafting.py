"""Drafting for the transformers engine's speculative steps, shared by text and vision-language targets.

:class:`Drafting` drafts a tree (``topk == 1``: a chain) per request with the draft model or EAGLE3 head
in ``state.draft`` (a :class:`hsx.engine.hf.kv.KV`): it first feeds the draft what it has not seen
(the last step's emitted tokens, and for a head the target's aux states at their parents), then expands
the frontier. The target is never touched here: the engine that mixes this in verifies the tree.
It needs ``self.spec`` (:class:`hsx.engine.hf.engine.SpecSettings`), ``self.head`` (True for an EAGLE3
head) and ``self.device``.
"""

from __future__ import annotations

import torch

from hsx.engine.hf.batch_state import BatchState
from hsx.engine.hf.tree import DraftTree


class Drafting:
    """The draft side of a speculative step (see the module docstring)."""

    def _draft_tree(self, state: BatchState) -> DraftTree:
        """Draft ``num_draft_tokens - 1`` nodes per request: expand the top-k frontier for num_steps levels
        and keep the best nodes by cumulative draft log-prob (EAGLE / SGLang tree drafting)."""
        k, n = self.spec.topk, self.spec.num_draft_tokens
        draft = state.draft
        root_logits, root_hidden = self._draft_catch_up(state)  # [B, V], head: [B, H]
        root_pos = draft.lengths - 1  # [B]
        pool = DraftTree.start(state.root, self.spec.pool_size)
        top = torch.log_softmax(root_logits.float(), -1).topk(k)  # [B, k]
        frontier = pool.add(1, top.indices, top.values, torch.zeros_like(top.indices), 1).expand(len(state.rids), k)
        # a head reads, with each frontier token, the output it produced at that token's parent
        hid = None if root_hidden is None else root_hidden[:, None].expand(-1, k, -1)  # [B, k, H]
        fed = frontier[:, :0]  # [B, f] pool nodes fed to the draft this step, in cache order
        start = 1 + k
        for level in range(2, self.spec.num_steps + 1):
            fed = torch.cat([fed, frontier], 1)
            positions = (root_pos[:, None] + level - 1).expand(-1, k)  # [B, k] the frontier sits at depth level - 1
            extra = {} if hid is None else {"draft_hidden": hid}
            out = draft.run(pool.tokens.gather(1, frontier), positions, pool.visibility(frontier, fed), partial=True,
                            **extra)
            child = torch.log_softmax(out.logits.float(), -1).topk(k)  # [B, k, k]
            child_score = pool.score.gather(1, frontier)[:, :, None] + child.values  # [B, k, k]
            parents = frontier[:, :, None].expand(-1, -1, k).flatten(1)  # [B, k * k]
            pool.add(start, child.indices.flatten(1), child_score.flatten(1), parents, level)
            best = child_score.flatten(1).topk(k).indices  # [B, k] best candidates go deeper
            frontier = start + best
            if hid is not None:
                hid = out.hidden.gather(1, (best // k)[:, :, None].expand(-1, -1, out.hidden.shape[2]))
            start += k * k
        if fed.shape[1]:
            draft.commit(torch.zeros_like(fed, dtype=torch.bool))  # forget the guesses; accepted ones come back as pending
        # keep the best n - 1 nodes. A child's score never exceeds its parent's and the stable sort ranks
        # earlier (shallower) pool entries first on ties, so the kept set contains its ancestors.
        best = torch.sort(pool.score[:, 1:], dim=1, descending=True, stable=True).indices[:, : n - 1] + 1
        root = torch.zeros_like(best[:, :1])
        return pool.subtree(torch.cat([root, best.sort(1).values], 1))  # [B, n] nodes in pool (depth) order

    def _draft_catch_up(self, state: BatchState) -> torch.Tensor:
        """Feed the draft what it has not seen (last step's emitted tokens, root last) as one block;
        returns its logits after the root ``[B, V]``."""
        draft, dev = state.draft, self.device
        q = state.pending.shape[1]
        pend_valid = torch.arange(q, device=dev)[None, :] < state.pending_len[:, None]  # [B, q]
        causal = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
        positions = draft.lengths[:, None] + torch.arange(q, device=dev)  # [B, q]
        extra = {} if state.pending_aux is None else {"draft_hidden": state.pending_aux}
        out = draft.run(state.pending, positions, causal[None] & pend_valid[:, None, :], partial=True, **extra)
        draft.commit(pend_valid)
        last = (torch.arange(len(state.rids), device=dev), state.pending_len - 1)
        return out.logits[last], (out.hidden[last] if self.head else None)
