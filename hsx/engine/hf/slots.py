"""Key/value slots of attention layers in storage allocated ahead, for rows kept compacted by :class:`hsx.engine.hf.kv.KV`."""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


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
