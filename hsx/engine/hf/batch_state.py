"""The embedded engine's running batch: one slot per request, their caches and pending tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from hsx.engine.hf.kv import KV


@dataclass
class BatchState:
    """The requests still running, slot i of every tensor is ``rids[i]``."""

    rids: list
    target: KV
    draft: KV | None
    # last step's emitted tokens (first pending_len per row): the draft has seen none of them, the
    # target all but the last one, which is the root of the next step
    pending: torch.Tensor  # [B, a]
    pending_len: torch.Tensor  # [B]
    n_out: torch.Tensor  # [B] completion tokens so far (CPU)
    # EAGLE3 head as draft: the target's aux states at the pending tokens' parents, [B, a, K * H]
    pending_aux: torch.Tensor | None = None

    @property
    def root(self) -> torch.Tensor:
        return self.pending.gather(1, (self.pending_len - 1)[:, None])[:, 0]  # [B]

    @property
    def free(self) -> list[int]:
        """Rows whose request finished (their id is None): a waiting request may take them."""
        return [i for i, rid in enumerate(self.rids) if rid is None]

    def without(self, rows: list[int]) -> "BatchState":
        """The state without batch rows ``rows``."""
        keep = torch.ones(len(self.rids), dtype=torch.bool)
        keep[rows] = False
        kept = keep.nonzero()[:, 0]  # CPU
        dev = kept.to(self.pending.device)
        for kv in (self.target, self.draft):
            if kv is not None:
                kv.select(dev)
        return BatchState(
            [self.rids[i] for i in kept.tolist()], self.target, self.draft,
            self.pending[dev], self.pending_len[dev], self.n_out[kept],
            None if self.pending_aux is None else self.pending_aux[dev],
        )

    def admit(self, new: "BatchState") -> "BatchState":
        """``new``'s requests take the free rows first, the rest are appended; free rows left over
        leave the batch. Only the new requests' slots are copied (a freed row is overwritten in place)."""
        holes = self.free
        h = min(len(holes), len(new.rids))
        dev = self.pending.device
        fill, src, rest = torch.tensor(holes[:h], dtype=torch.long), torch.arange(h), torch.arange(h, len(new.rids))
        for mine, theirs in ((self.target, new.target), (self.draft, new.draft)):
            if mine is not None:
                mine.put(fill.to(dev), theirs, src.to(dev))
                if rest.numel():
                    mine.extend(theirs, rest.to(dev))

        def merged(old, young, where):
            width = max(old.shape[1], young.shape[1]) if old.dim() > 1 else None
            old, young = (_widen(old, width), _widen(young, width)) if width else (old.clone(), young)
            i, j, k = (t.to(where) for t in (fill, src, rest))
            old[i] = young[j]
            return torch.cat([old, young[k]])

        rids = list(self.rids)
        for i, rid in zip(holes[:h], new.rids[:h]):
            rids[i] = rid
        state = BatchState(
            rids + new.rids[h:], self.target, self.draft,
            merged(self.pending, new.pending, dev), merged(self.pending_len, new.pending_len, dev),
            merged(self.n_out, new.n_out, "cpu"),
            None if self.pending_aux is None else merged(self.pending_aux, new.pending_aux, dev),
        )
        return state.without(holes[h:]) if len(holes) > h else state


def _widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t [B, w, ...]`` zero-padded along dim 1 to ``width`` (a new tensor)."""
    pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad)


def admissible(waiting: deque, free: int, max_tokens: int | None, same_length: bool = False) -> list:
    """Pop the next requests to prefill together: at most ``free`` of them, and (after the first)
    only while the padded batch stays within ``max_tokens`` prompt tokens; with ``same_length``,
    only while the prompts are as long as the first (no padding: recurrent layers)."""
    batch = [waiting.popleft()]
    width = batch[0][1].numel()
    while waiting and len(batch) < free:
        if same_length and waiting[0][1].numel() != width:
            break
        w = max(width, waiting[0][1].numel())
        if max_tokens is not None and w * (len(batch) + 1) > max_tokens:
            break
        batch.append(waiting.popleft())
        width = w
    return batch
