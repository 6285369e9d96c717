"""The engine's batched KV cache: storage allocated ahead, rows of different lengths kept compacted.

:class:`KV` is the one cache object the engine drives, for the target and the draft alike: a
forward appends its new slots, and :meth:`KV.commit` (the only place a row's tokens move) keeps
the ones each row accepted. A prompt prefilled in chunks is a run and a commit per chunk. On a
model with recurrent layers the commit also gives each row the state after its kept tokens
(:mod:`hsx.engine.hf.state`).
"""

from __future__ import annotations

import torch

from hsx.engine.hf.capture import Driven, forward
from hsx.engine.hf.slots import SlotCache
from hsx.engine.hf.state import StateCache


def compressors(driven: Driven) -> dict:
    """The compressor module of each compressed attention layer of the model, by layer index."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    from hsx.engine.families import COMPRESSED
    from hsx.engine.hf.compressed import find_compressors

    kinds = get_layer_types_and_kwargs(driven.model.config.get_text_config(decoder=True))[0]
    ids = [i for i, kind in enumerate(kinds) if kind in COMPRESSED]
    return find_compressors(driven.model.get_submodule(driven.layout.blocks), ids) if ids else {}


class KV:
    """A batched cache plus, per row, how many committed slots hold that row's tokens, and every slot's position.

    Rows stay compacted: row i's tokens are slots ``[0, lens[i])``; slots from there to the committed
    width are stale. Slot order does not matter to attention (positions are baked into the keys,
    visibility is the mask), so a row's tokens may sit in any order inside that prefix. Every layer
    keeps every slot, sliding ones included (transformers' sliding cache layers drop old slots by
    count, which is wrong for rows of different lengths); the window is applied by the mask, from
    the slots' positions. Storage is allocated ahead (``capacity`` slots per row) so a step writes
    only its new slots.
    """

    def __init__(self, driven: Driven, batch: int, device, capacity: int = 0):
        self.driven = driven
        stateful = driven.plan.stateful
        self.cache = StateCache(driven.model.config.get_text_config(decoder=True), capacity,
                                compressors(driven)) if stateful else SlotCache(capacity)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # [B] committed tokens per row
        self.width = 0  # committed slots (max of lens)
        self._pos = torch.zeros(batch, max(capacity, 1), dtype=torch.long, device=device)  # every slot's position
        self.filled = 0  # slots written: the committed width plus those not committed yet

    @property
    def lengths(self) -> torch.Tensor:
        return self.lens  # [B] tokens seen == position of the next token

    @property
    def pos(self) -> torch.Tensor:
        return self._pos[:, : self.filled]

    @property
    def slot_layers(self) -> list:
        return getattr(self.cache, "slots", self.cache.layers)

    @property
    def state_layers(self) -> list:
        return getattr(self.cache, "states", [])

    def run(self, input_ids, positions, block, partial: bool = False, **extra):
        """Forward ``input_ids [B, q]`` at ``positions [B, q]``; ``block [B, q, uncommitted + q]`` is
        visibility among new slots. ``partial``: the next commit may keep only a prefix of each row's
        new tokens, so recurrent layers record the state after each of them."""
        batch, q = input_ids.shape
        if partial:
            for layer in self.state_layers:
                layer.record()
        seen = torch.arange(self.width, device=self.lens.device)[None, :] < self.lens[:, None]  # [B, S]
        seen = seen[:, None, :].expand(batch, q, -1)
        end = self.filled + q
        self._reserve_pos(end)
        self._pos[:, self.filled : end] = positions
        self.filled = end
        return forward(self.driven, input_ids, positions, self.pos, torch.cat([seen, block], 2), self.cache, **extra)

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the slots appended since the last commit where ``keep [B, n]``; drop the rest.

        The only place a row's tokens move: its kept new slots go right after its committed ones
        (the rest are left behind as stale slots). Work is proportional to the new slots only.
        """
        start, n = self.width, keep.shape[1]
        if self.cache.get_seq_length() != start + n or self.filled != start + n:
            raise RuntimeError(f"cache holds {self.cache.get_seq_length()} slots ({self.filled} positions), "
                               f"commit describes {start} + {n}")
        kept = keep.sum(1)
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # [B, n] kept slots first
        dest = self.lens[:, None] + torch.arange(n, device=keep.device)  # [B, n]
        if n and bool(kept.any()) and not bool((dest == start + order).all()):
            for layer in self.slot_layers:
                layer.move(start, order, dest)
            self._pos.scatter_(1, dest, self._pos[:, start : start + n].gather(1, order))
        if self.state_layers:
            if not bool((keep == (torch.arange(n, device=keep.device) < kept[:, None])).all()):
                raise RuntimeError("a recurrent layer keeps a prefix of a row's new tokens, the commit asks for others")
            for layer in self.state_layers:
                layer.keep(kept, n)
        self.lens = self.lens + kept
        self.width = int(self.lens.max()) if self.lens.numel() else 0
        self.filled = self.width
        for layer in self.slot_layers:
            layer.set_width(self.width)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (finished requests leave the batch)."""
        self._check_committed("select")
        for layer in self.slot_layers:
            layer.select(rows)
        for layer in self.state_layers:
            layer.select_rows(rows)
        self.lens, self._pos = self.lens[rows], self._pos[rows]
        self.commit(self._none())

    def put(self, rows: torch.Tensor, other: "KV", src: torch.Tensor) -> None:
        """Rows ``rows`` of this batch take the requests in rows ``src`` of ``other`` (a freed row is
        overwritten in place: only the new request's slots are copied)."""
        self._check_committed("put")
        other._check_committed("put")
        for layer, theirs in zip(self.slot_layers, other.slot_layers):
            layer.put(rows, theirs, src)
        for layer, theirs in zip(self.state_layers, other.state_layers):
            layer.put_rows(rows, theirs, src)
        self._reserve_pos(other.width)
        self._pos[rows, : other.width] = other._pos[src, : other.width]
        self.lens = self.lens.clone()
        self.lens[rows] = other.lens[src]
        self.commit(self._none())

    def extend(self, other: "KV", src: torch.Tensor) -> None:
        """Append the requests in rows ``src`` of ``other`` to this batch."""
        self._check_committed("extend")
        other._check_committed("extend")
        for layer, theirs in zip(self.slot_layers, other.slot_layers):
            layer.extend(theirs, src)
        for layer, theirs in zip(self.state_layers, other.state_layers):
            layer.extend_rows(theirs, src)
        self._reserve_pos(other.width)
        theirs = other._pos[src, : other.width]
        self._pos = torch.cat([self._pos, torch.nn.functional.pad(theirs, (0, self._pos.shape[1] - theirs.shape[1]))])
        self.lens = torch.cat([self.lens, other.lens[src]])
        self.commit(self._none())

    def _reserve_pos(self, need: int) -> None:
        if need > self._pos.shape[1]:
            grown = self._pos.new_zeros(self._pos.shape[0], max(need, 2 * self._pos.shape[1]))
            grown[:, : self.filled] = self._pos[:, : self.filled]
            self._pos = grown

    def _none(self) -> torch.Tensor:
        return torch.zeros(self.lens.shape[0], 0, dtype=torch.bool, device=self.lens.device)  # a commit of no slots

    def _check_committed(self, what: str) -> None:
        if self.filled != self.width:
            raise RuntimeError(f"{what} with {self.filled - self.width} uncommitted slots")
