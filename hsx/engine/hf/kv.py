"""The engine's batched KV cache: storage allocated ahead, rows of different lengths kept compacted.

:class:`KV` is the one cache object the engine drives, for the target and the draft alike: a
forward appends its new slots, and :meth:`KV.commit` (the only place a row's tokens move) keeps
the ones each row accepted. A prompt prefilled in chunks is a run and a commit per chunk.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from hsx.engine.hf.capture import Driven, forward


class SlotLayer(DynamicLayer):
    """One layer's keys and values in storage ``[B, heads, capacity, head_dim]`` allocated ahead:
    appending writes into it instead of copying the whole cache (``DynamicLayer`` concatenates), and
    ``keys``/``values`` are views of the used width. Grows by doubling when the capacity runs out."""

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity_hint = capacity
        self.width = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.k_buf = key_states.new_zeros(*key_states.shape[:2], 0, key_states.shape[3])
        self.v_buf = value_states.new_zeros(*value_states.shape[:2], 0, value_states.shape[3])
        self.is_initialized = True
        self.reserve(max(self.capacity_hint, key_states.shape[2]))

    def reserve(self, need: int) -> None:
        """Room for ``need`` slots per row, keeping the used ones."""
        cap = self.k_buf.shape[2]
        if need <= cap:
            return
        cap = max(need, 2 * cap)
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], cap, old.shape[3])  # never garbage: a masked NaN still poisons a softmax
            new[:, :, : self.width] = old[:, :, : self.width]
            setattr(self, name, new)
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self.k_buf[:, :, : self.width], self.v_buf[:, :, : self.width]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.width + key_states.shape[2]
        self.reserve(end)
        self.k_buf[:, :, self.width : end] = key_states
        self.v_buf[:, :, self.width : end] = value_states
        self.width = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width

    def set_width(self, width: int) -> None:
        self.width = width
        self._views()

    def move(self, start: int, order: torch.Tensor, dest: torch.Tensor) -> None:
        """Slots ``start + order [B, m]`` of each row go to slots ``dest [B, m]`` (read all, then write)."""
        rows = torch.arange(order.shape[0], device=order.device)[:, None].expand_as(order)
        for buf in (self.k_buf, self.v_buf):
            buf[rows, :, dest] = buf[rows, :, start + order]  # [B, m, heads, dim]

    def select(self, rows: torch.Tensor) -> None:
        self.k_buf, self.v_buf = self.k_buf[rows], self.v_buf[rows]
        self._views()

    def put(self, rows: torch.Tensor, other: "SlotLayer", src: torch.Tensor) -> None:
        """Rows ``rows`` take ``other``'s rows ``src``, from slot 0 (only their used slots are copied)."""
        w = other.width
        self.reserve(w)
        self.k_buf[rows, :, :w] = other.k_buf[src, :, :w]
        self.v_buf[rows, :, :w] = other.v_buf[src, :, :w]

    def extend(self, other: "SlotLayer", src: torch.Tensor) -> None:
        """Append ``other``'s rows ``src`` to the batch."""
        self.reserve(other.width)
        for name in ("k_buf", "v_buf"):
            mine, theirs = getattr(self, name), getattr(other, name)[src, :, : other.width]
            setattr(self, name, torch.cat([mine, torch.nn.functional.pad(theirs, (0, 0, 0, mine.shape[2] - theirs.shape[2]))]))
        self._views()


class SlotCache(DynamicCache):
    """A ``DynamicCache`` of :class:`SlotLayer` (full-length layers everywhere: see :class:`KV`)."""

    def __init__(self, capacity: int = 0):
        Cache.__init__(self, layer_class_to_replicate=partial(SlotLayer, capacity))


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
        self.cache = SlotCache(capacity)
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

    def run(self, input_ids, positions, block, **extra):
        """Forward ``input_ids [B, q]`` at ``positions [B, q]``; ``block [B, q, uncommitted + q]`` is
        visibility among new slots."""
        batch, q = input_ids.shape
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
            for layer in self.cache.layers:
                layer.move(start, order, dest)
            self._pos.scatter_(1, dest, self._pos[:, start : start + n].gather(1, order))
        self.lens = self.lens + kept
        self.width = int(self.lens.max()) if self.lens.numel() else 0
        self.filled = self.width
        for layer in self.cache.layers:
            layer.set_width(self.width)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (finished requests leave the batch)."""
        self._check_committed("select")
        for layer in self.cache.layers:
            layer.select(rows)
        self.lens, self._pos = self.lens[rows], self._pos[rows]
        self.commit(self._none())

    def put(self, rows: torch.Tensor, other: "KV", src: torch.Tensor) -> None:
        """Rows ``rows`` of this batch take the requests in rows ``src`` of ``other`` (a freed row is
        overwritten in place: only the new request's slots are copied)."""
        self._check_committed("put")
        other._check_committed("put")
        for layer, theirs in zip(self.cache.layers, other.cache.layers):
            layer.put(rows, theirs, src)
        self._reserve_pos(other.width)
        self._pos[rows, : other.width] = other._pos[src, : other.width]
        self.lens = self.lens.clone()
        self.lens[rows] = other.lens[src]
        self.commit(self._none())

    def extend(self, other: "KV", src: torch.Tensor) -> None:
        """Append the requests in rows ``src`` of ``other`` to this batch."""
        self._check_committed("extend")
        other._check_committed("extend")
        for layer, theirs in zip(self.cache.layers, other.cache.layers):
            layer.extend(theirs, src)
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
