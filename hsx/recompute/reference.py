"""The independent reference: a plain teacher-forced forward of the shards' model over the stored tokens.

It shares no code with the engines' decoding paths: no 4-D masks, no draft tree, no row
collection, no capture hooks of theirs. It shares the loading and the layout (which module list
holds the blocks, which norm feeds lm_head: :func:`hsx.engine.families.find_layout`, proved on a
forward against transformers' own ``hidden_states`` before the first sample). One right-padded batch per call, positions ``0..N-1`` per
sample (right padding never shifts the real tokens' positions, and causal attention never lets
them see the padding), with no cache; or one long sequence a chunk of tokens at a time through
transformers' own ``DynamicCache`` and causal mask (:meth:`Reference.chunks`).
"""

from __future__ import annotations


from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from hsx.align import FINAL, ModelShape
from hsx.errors import HsxError


def neighbour_sources(sources: Sequence[int | str], num_layers: int) -> list[int | str]:
    """Sources worth comparing a column against besides its own: boundaries b-1 and b+1, and the
    other side of the final norm (boundary L for ``final``, ``final`` for boundary L)."""
    out: list[int | str] = []
    for s in sources:
        if s == FINAL:
            out.append(num_layers)
            continue
        out += [b for b in (s - 1, s + 1) if 0 <= b <= num_layers]
        if s == num_layers:
            out.append(FINAL)
    return out


def same_width(shape: ModelShape, source: int | str, others: Sequence[int | str]) -> list[int | str]:
    """Of ``others``, the sources as wide as ``source`` (on a hyper-connection model ``final`` is one stream,
    boundary L all of them: neither can stand in for the other)."""
    return [s for s in others if shape.width_of(s) == shape.width_of(source)]


@dataclass
class Reference:
    """A loaded model that returns the states of chosen sources for a batch of token sequences."""

    model: torch.nn.Module
    shape: ModelShape
    device: torch.device
    dtype: torch.dtype
    decoder: torch.nn.Module  # the module holding the blocks and the final norm, without lm_head
    norm: torch.nn.Module  # the final norm: its input is boundary L
    recurrent: bool = False  # some layers keep a recurrent state (linear attention, convolutions, Mamba-2)
    # hyper-connection models (DeepSeek-V4): boundary L is the last block's streams, not the norm's input
    last_block: torch.nn.Module | None = None

    @staticmethod
    def load(path: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False) -> "Reference":
        from hsx.engine.families import load_causal_lm

        try:  # sdpa, or eager where the family has no sdpa path (MiMo-V2-Flash, Gemma 2, GPT-OSS)
            model = load_causal_lm(path, dtype, trust_remote_code, what="model for the recompute")
        except (OSError, ValueError) as e:
            raise HsxError(f"cannot load model {path!r} for the recompute: {e}") from None
        return Reference.wrap(model.to(device).eval())

    @staticmethod
    def wrap(model: torch.nn.Module) -> "Reference":
        """A reference around a model already in memory (e.g. a script's own)."""
        from hsx.engine.families import check_layout, find_layout, has_recurrent_layers

        p = next(model.parameters())
        layout = find_layout(model, "model for the recompute")
        check_layout(model.eval(), layout, "model for the recompute")
        decoder = model.get_submodule(layout.blocks.rpartition(".")[0])
        last_block = None if layout.collapse is None else model.get_submodule(layout.blocks)[-1]
        return Reference(model, ModelShape.from_config(model.config), p.device, p.dtype, decoder, layout.norm(model),
                         has_recurrent_layers(model), last_block)

    def states(self, input_ids: Sequence[torch.Tensor], sources: Sequence[int | str]) -> dict:
        """``{source: [B, T, H] float32}`` for the sequences ``input_ids`` (T = the longest), on ``self.device``.

        transformers' ``hidden_states[b]`` is boundary b for b < L and its last entry is ``final``;
        boundary L (the last block's output before the norm) is the final norm's input, taken with
        a pre-hook. Positions past a sequence's end hold padding states: callers mask them.
        """
        lengths = torch.tensor([t.numel() for t in input_ids])
        width = int(lengths.max())
        ids = torch.zeros(len(input_ids), width, dtype=torch.long)
        for i, t in enumerate(input_ids):
            ids[i, : t.numel()] = t.reshape(-1).long()
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # [B, T]
        self._check_ids(ids)
        return self._forward(sources, input_ids=ids.to(self.device), attention_mask=mask.to(self.device))

    def sample_states(self, samples: Sequence, ids: Sequence[torch.Tensor], sources: Sequence[int | str],
                      sample_ids: list[str]) -> tuple[dict, dict]:
        """:meth:`states` of a batch of samples (their token ids ``ids``), and findings about their inputs by
        batch index (none here; a vision-language reference checks the stored positions)."""
        return self.states(ids, sources), {}

    def chunks(self, input_ids: torch.Tensor, sources: Sequence[int | str], size: int
               ) -> Iterator[tuple[int, int, dict]]:
        """One sequence ``input_ids [N]`` ``size`` tokens at a time: ``(start, stop, {source: [1, q, H]
        float32})`` for positions ``start..stop-1``, each chunk one forward at those positions that sees
        the chunks before it through transformers' ``DynamicCache`` (keys and values, no states).
        Only one chunk's states exist at a time, unless the caller keeps them."""
        from transformers import DynamicCache

        ids = input_ids.reshape(-1).long()
        self._check_ids(ids)
        cache = DynamicCache(config=self.model.config)
        for start in range(0, ids.numel(), size):
            stop = min(start + size, ids.numel())
            positions = torch.arange(start, stop, device=self.device)[None]  # [1, q]
            yield start, stop, self._forward(sources, input_ids=ids[None, start:stop].to(self.device),
                                             position_ids=positions, cache=cache, use_cache=True)

    def _check_ids(self, ids: torch.Tensor) -> None:
        vocab = self.model.config.get_text_config().vocab_size
        if ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise HsxError(f"stored token ids outside 0..{vocab - 1}: these shards were not made with this model")

    def _forward(self, sources: Sequence[int | str], **inputs) -> dict:
        """One forward of the decoder with ``inputs``; the states of ``sources`` for its tokens, float32."""
        num_layers = self.shape.num_layers
        box = {}

        def keep_input(module, args):  # returns None: a pre-hook's return value would replace the input
            box["pre"] = args[0]

        def keep_output(module, args, output):
            box["pre"] = output[0] if isinstance(output, tuple) else output

        if self.last_block is not None:  # the streams before their collapse
            handle = self.last_block.register_forward_hook(keep_output)
        else:
            handle = self.norm.register_forward_pre_hook(keep_input)
        try:  # the decoder without lm_head: no [B, T, vocab] logits are made
            with torch.inference_mode():
                out = self.decoder(**inputs, output_hidden_states=True)
        finally:
            handle.remove()
        hs = out.hidden_states
        if len(hs) != num_layers + 1:
            raise HsxError(f"model returned {len(hs)} hidden-state entries, expected num_layers + 1 = {num_layers + 1}")

        def pick(s):
            if s == FINAL:
                return hs[num_layers]
            state = box["pre"] if s == num_layers else hs[s]
            # hyper-connection streams [B, T, hc_mult, hidden], flattened stream by stream as the engines store them
            return state.flatten(2) if state.dim() == 4 else state

        return {s: pick(s).float() for s in dict.fromkeys(sources)}
