"""Recurrent layers in the engine's batched cache: transformers' own state layers, rolled back per row.

A linear-attention (Gated DeltaNet, KDA), short-convolution (LFM2) or Mamba-2 (Falcon-H1) layer
keeps per row a recurrent state and the last inputs of its causal convolution (transformers'
``LinearAttentionLayer``), not a key and a value per token: a token it has seen cannot be dropped.
So the engine

* never puts padding before a row's real tokens (requests admitted together have one prompt
  length; a teacher-forced prefill pads on the right, after every real token);
* before a forward whose tokens may be kept only in part (a verify step, a draft's catch-up and
  its guesses), turns on transformers' past recording: the layer keeps the state after every
  new token, and its convolution window over all of them (:meth:`StateLayer.record`);
* at the commit, gives each row the state after the tokens it kept, which must be a prefix of
  them (:meth:`StateLayer.keep`): a chain verifies, a draft tree cannot.

Attention layers stay :class:`hsx.engine.hf.kv.SlotLayer`; a ``hybrid`` layer (Mamba-2 beside
attention) is both (:class:`HybridLayer`), and so is a compressed attention layer
(:class:`hsx.engine.hf.compressed.CompressedLayer`: keys in slots, a compressor state per row).
"""

from __future__ import annotations

import torch
from contextlib import nullcontext
from functools import partial

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, LinearAttentionLayer, get_layer_types_and_kwargs

from hsx.engine.families import COMPRESSED, CONV, FULL, HYBRID, LINEAR, SLIDING
from hsx.engine.hf.compressed import CompressedLayer, driving
from hsx.engine.hf.slots import SlotLayer

EVERY_TOKEN = 1 << 30  # recurrent states to keep while recording: one per new token (transformers takes the min)


class StateLayer(LinearAttentionLayer):
    """One recurrent layer's conv windows and states ``[B, ...]``, recorded per token when asked."""

    def __init__(self, number_of_states: int = 1, **kwargs):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def record(self) -> None:
        """Keep the state after every token of the forwards until the next :meth:`keep`."""
        if not self.record_past:
            self.record_past, self.recurrent_states_to_keep = True, EVERY_TOKEN
            self.recurrent_states_history = {i: [] for i in range(self.number_of_states)}

    def keep(self, counts: torch.Tensor, n: int) -> None:
        """Row b keeps the first ``counts[b]`` of the ``n`` tokens since the last keep."""
        if not self.record_past:
            if bool((counts != n).any()):
                raise RuntimeError(f"a recurrent layer saw {n} tokens unrecorded and cannot drop {n - counts.min()}")
            return
        rows = torch.arange(counts.shape[0], device=counts.device)
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                conv, width = self.conv_states[i], self.conv_kernel_size[i]  # [B, C, width + n]
                if conv.shape[-1] != width + n:
                    raise RuntimeError(f"conv window of {conv.shape[-1]} inputs, expected {width} + {n} recorded")
                at = (counts[:, None] + torch.arange(width, device=conv.device))[:, None, :]  # [B, 1, width]
                self.conv_states[i] = conv.gather(2, at.expand(-1, conv.shape[1], -1))
            if self.is_recurrent_states_initialized[i]:
                steps = self.recurrent_states_history[i] + [self.recurrent_states[i]]  # states after 0..n tokens
                if len(steps) != n + 1:
                    raise RuntimeError(f"{len(steps)} recorded recurrent states, expected {n} + 1")
                self.recurrent_states[i] = torch.stack(steps)[counts, rows]
        self.record_past, self.recurrent_states_to_keep = False, 0
        self.recurrent_states_history = {}

    def _states(self):
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                yield self.conv_states, i
            if self.is_recurrent_states_initialized[i]:
                yield self.recurrent_states, i

    def select_rows(self, rows: torch.Tensor) -> None:
        for states, i in self._states():
            states[i] = states[i][rows]

    def put_rows(self, rows: torch.Tensor, other: "StateLayer", src: torch.Tensor) -> None:
        for (states, i), (theirs, _) in zip(self._states(), other._states()):
            states[i][rows] = theirs[i][src]

    def extend_rows(self, other: "StateLayer", src: torch.Tensor) -> None:
        for (states, i), (theirs, _) in zip(self._states(), other._states()):
            states[i] = torch.cat([states[i], theirs[i][src]])


class HybridLayer(StateLayer, SlotLayer):
    """A layer with a recurrent mixer and attention side by side (Falcon-H1): state and key/value slots."""

    def __init__(self, capacity: int = 0, number_of_states: int = 1, **kwargs):
        SlotLayer.__init__(self, capacity)
        StateLayer.__init__(self, number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # attention calls it with keys and values; the recurrent mixer with keywords naming its states
        if args:
            SlotLayer.lazy_initialization(self, *args)
        else:
            StateLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        return SlotLayer.get_seq_length(self)


class StateCache(Cache):
    """One cache layer per decoder layer, by its kind: slots for attention, states for recurrent mixers, both
    for compressed attention (``compressors``: each such layer's compressor module, by layer index)."""

    def __init__(self, config, capacity: int = 0, compressors: dict | None = None):
        types, kwargs = get_layer_types_and_kwargs(config)
        layers = []
        for i, (kind, kw) in enumerate(zip(types, kwargs)):
            states = kw.get("number_of_states", 1)
            if kind in (FULL, SLIDING):  # the window is in the mask: every slot is kept (see KV)
                layers.append(SlotLayer(capacity))
            elif kind in (LINEAR, CONV):
                layers.append(StateLayer(states))
            elif kind == HYBRID:
                layers.append(HybridLayer(capacity, states))
            elif kind in COMPRESSED:  # transformers' own cache layer of the kind holds one row's compressor state
                layers.append(CompressedLayer(i, partial(DYNAMIC_LAYER_TYPE_MAPPING[kind], **kw), capacity))
            else:  # AttentionPlan refuses these first
                raise RuntimeError(f"no cache layer for layer kind {kind!r}")
        Cache.__init__(self, layers=layers)
        self.slots = [layer for layer in layers if isinstance(layer, SlotLayer)]
        self.states = [layer for layer in layers if isinstance(layer, (StateLayer, CompressedLayer))]
        self.compressed = [layer for layer in layers if isinstance(layer, CompressedLayer)]
        self.compressors = compressors or {}

    def driving(self):
        """The context a forward through this cache runs in: compressors driven per row, where there are any."""
        return driving(self.compressed, self.compressors) if self.compressed else nullcontext()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Key/value slots written (the recurrent layers count no slots)."""
        return self.slots[0].get_seq_length() if self.slots else 0
