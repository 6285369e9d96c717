"""One forward of a model the transformers engine drives, and the boundaries it keeps from it.

The engine never asks a model for ``output_hidden_states``: that tuple holds every block's output,
``(L + 1) x tokens x hidden`` for a forward, while a run stores a few boundaries. :class:`Capture`
puts forward hooks on the modules that produce the boundaries it is asked for, and keeps those
tensors alone (docs/FORMAT.md, "Layer boundaries"):

* boundary 0 is the first block's input (the embedding output, as the model computes it);
* boundary b, ``1 <= b < L``, is block b-1's output (its first element when a block returns a tuple);
* boundary L is the final norm's input, ``final`` its output (lm_head's input).

On a hyper-connection model (DeepSeek-V4, ``hc_mult`` streams ``[B, q, hc_mult, hidden]`` between
blocks) a boundary is all the streams, flattened stream by stream to ``hc_mult * hidden`` (stream
0's values first; SGLang's ``spec_hidden_size``), and boundary L is the last block's output, before
the module that collapses the streams into the final norm's input.

These are the tensors transformers' own ``hidden_states`` are made of (it records them with hooks
on the same blocks), so the rows are the same bits; :func:`hsx.engine.families.check_layout` proves
each of these points against ``hidden_states`` on one short forward before the engine is used (and
that the last block's output is the final norm's input, or its collapse's). A tensor is kept as
the module hands it over, never reshaped (streams are only flattened, a view of the same values):
its width is checked against the column's when the rows are collected.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterable

import torch

from hsx.align import FINAL
from hsx.engine.families import AttentionPlan, Layout, check_layout, find_layout, model_type, slot_limit
from hsx.errors import HsxError

# The oldest transformers this engine is tested with: it passes the cache as ``cache=``, which
# older releases ignore silently (5.19 runs every forward without a cache).
MIN_TRANSFORMERS = "5.24"


def check_transformers() -> None:
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise HsxError(f"the transformers engine needs transformers >= {MIN_TRANSFORMERS}, found "
                       f"{transformers.__version__} (the SGLang engine does not have this limit)")


@dataclass(frozen=True)
class Driven:
    """A model with what the engine learned about it before its first forward."""

    model: torch.nn.Module
    plan: AttentionPlan
    layout: Layout | None
    slices_logits: bool = False  # forward takes logits_to_keep: lm_head runs only where logits are read
    max_slots: int | None = None  # key slots per forward within which the rows are exact (families.slot_limit)

    @staticmethod
    def of(model, what: str) -> "Driven":
        check_transformers()
        model = model.eval()  # the layout check compares tensors of one forward: no dropout
        plan = AttentionPlan.from_model(model, what)
        layout = find_layout(model, what)
        check_layout(model, layout, what)
        return Driven(model, plan, layout, "logits_to_keep" in inspect.signature(model.forward).parameters,
                      slot_limit(model))

    def logits_at(self, positions: torch.Tensor | int) -> dict:
        """Forward keywords computing logits only at ``positions`` (a 1-D tensor of sequence indices,
        the same for every row; or an int: that many last positions), where the model can."""
        return {"logits_to_keep": positions} if self.slices_logits else {}

    def no_logits(self, device) -> dict:
        """Forward keywords that leave lm_head out (zero positions kept), where the model can."""
        return self.logits_at(torch.zeros(0, dtype=torch.long, device=device))


def forward(driven: Driven, input_ids, q_pos, k_pos, visible, cache, **extra):
    """One forward of ``input_ids [B, q]`` at positions ``q_pos [B, q]`` that sees the key slots
    (at positions ``k_pos [B, K]``, the new ones last) where ``visible [B, q, K]``."""
    batch, q = input_ids.shape
    if driven.max_slots is not None and visible.shape[2] > driven.max_slots:
        raise HsxError(f"{model_type(driven.model)}: a forward over {visible.shape[2]} cache slots; this model reads "
                       f"a slot index as a position (attention temperature tuning), so the engine's rows are exact "
                       f"within {driven.max_slots} slots only: use shorter prompts or max_new_tokens, or a smaller batch")
    visible = visible.clone()
    diag = torch.arange(q, device=visible.device)
    # every query sees itself: a fully masked row turns into NaN under eager attention
    visible[:, diag, visible.shape[2] - q + diag] = True
    model = driven.model
    # a cache with compressed attention drives the compressors row by row while the model runs (hsx.engine.hf.compressed)
    with (cache.driving() if hasattr(cache, "driving") else nullcontext()):
        return model(
            input_ids=input_ids,
            position_ids=q_pos,
            attention_mask=driven.plan.masks(visible, q_pos, k_pos, model.dtype),
            cache=cache,
            use_cache=cache is not None,
            output_hidden_states=False,  # explicit: a config saying True would make the model keep every block's output
            **extra,
        )


def _streams_flat(state):
    """``[B, q, hc_mult, hidden]`` hyper-connection streams as ``[B, q, hc_mult * hidden]``, stream 0 first
    (a view); any other tensor as it is."""
    return state.flatten(2) if isinstance(state, torch.Tensor) and state.dim() == 4 else state


class Capture:
    """Forward hooks keeping the boundaries ``sources`` (ints and FINAL) of the forwards run inside ``with``.

    ``states`` maps each source to its ``[B, q, ...]`` tensor of the latest forward; nothing else is held.
    """

    def __init__(self, driven: Driven, sources: Iterable[int | str], num_layers: int):
        self.model = driven.model
        self.layout = driven.layout
        self.sources = tuple(dict.fromkeys(sources))
        self.num_layers = num_layers
        self.states: dict = {}
        self.handles: list = []

    def __enter__(self) -> "Capture":
        blocks = self.model.get_submodule(self.layout.blocks)
        norm = self.layout.norm(self.model)
        wanted = set(self.sources)
        if 0 in wanted:
            self.handles.append(blocks[0].register_forward_pre_hook(self._keep_input(0)))
        for b in sorted(s for s in wanted if s != FINAL and 0 < s < self.num_layers):
            self.handles.append(blocks[b - 1].register_forward_hook(self._keep_output(b)))
        if self.num_layers in wanted and self.layout.collapse is not None:  # the streams, before their collapse
            self.handles.append(blocks[-1].register_forward_hook(self._keep_output(self.num_layers)))
        elif self.num_layers in wanted:
            self.handles.append(norm.register_forward_pre_hook(self._keep_input(self.num_layers)))
        if FINAL in wanted:
            self.handles.append(norm.register_forward_hook(self._keep_output(FINAL)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _keep_input(self, source):
        def hook(module, args):  # returns None: a pre-hook's return value would replace the input
            self.states[source] = _streams_flat(args[0]) if args else None

        return hook

    def _keep_output(self, source):
        def hook(module, args, output):
            self.states[source] = _streams_flat(output[0] if isinstance(output, tuple) else output)

        return hook

    def take(self, sources: Iterable[int | str]) -> torch.Tensor:
        """Boundaries ``sources`` of the latest forward concatenated along the width, ``[B, q, len(sources) * W]``."""
        parts = []
        for s in sources:
            state = self.states.get(s)
            if not isinstance(state, torch.Tensor):
                where = "the final norm" if s in (FINAL, self.num_layers) else f"block {max(s - 1, 0)}"
                raise HsxError(f"boundary {s!r} was not captured: {where} did not run with a tensor as its "
                               f"{'input' if s in (0, self.num_layers) else 'output'} in the latest forward")
            parts.append(state)
        return torch.cat(parts, -1)

    def clear(self) -> None:
        """Forget the latest forward's states (their memory goes once nothing else holds them)."""
        self.states = {}
