"""Vision-language targets on the transformers engine: batched prefill and plain decoding over chats
with images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, LLaVA, Gemma 3;
:mod:`hsx.data.images` renders their rows).

A batch is right-padded; one forward gets the padded ids, a 2-D attention mask, the pixels of every
image of the batch in row order (and ``image_grid_thw`` where the model has one) and explicit
positions, so the model's own position guesses never decide alignment:

* mRoPE models (Qwen2/2.5/3-VL, Qwen3.5): the 3-D positions of the prompt come from the model's
  ``get_rope_index`` over the expanded ids with their image-token types; each row's ``rope_delta``
  (its largest prompt position + 1 - its prompt length) is carried into every decode step, whose
  token sits at ``prompt_len + t + rope_delta`` on all three axes;
* other models: ``cumsum(mask) - 1``.

Gemma 3's prefill also gets ``token_type_ids`` (1 on the soft image tokens, 0 on text and padding): the
model lets each image block attend to itself both ways, on top of the causal (and sliding-window)
mask. Decode steps get none, as transformers' own ``generate`` does: a generated token is text and
attends causally to the cache. On a target with sliding-window layers (Gemma 3) the cache keeps every
slot and each decode (and verify) step gets the engine's own masks, the window counted in positions
(:func:`hsx.engine.families.window_plan`).

Qwen3.5's language model has Gated DeltaNet (linear-attention) layers beside full attention: each keeps
a recurrent state per row that every token it is fed moves, padding included (transformers zeroes a
padded token's input, but the state still decays by that step's gate). A batched prefill pads on the
right, after every real token, so its rows are exact; generate decodes each prompt alone (one row
per forward, no padding), and speculative decoding is refused on such targets (:func:`refuse_drafts`).

The language model's blocks are hooked at their inputs: boundary b < L is what block b receives, so
boundary 0 is the merged text and vision embeddings (image tokens hold the projected vision
features; on Gemma 3 the text embeddings are already scaled by sqrt(hidden), the vision features are
not); L is the final norm's input, ``final`` its output. On deepstack models (Qwen3-VL, Qwen3-VL-MoE;
Qwen3.5 has none) the vision features of the tower's deepstack layers are added at image tokens to the
outputs of blocks 0..k-1 before the next block receives them: boundaries 1..k are after that add (transformers'
``hidden_states[b]`` and SGLang's capture hold block b-1's output before it); elsewhere block b's
input is block b-1's output. Rows follow the usual alignment (``hsx.align``): row j is the state after token j.

Speculative decoding with a draft model or an EAGLE3 head, chains only, is
:mod:`hsx.engine.hf.vision_drafts`. Not run here (refused before the first forward): draft trees,
drafts on targets with recurrent layers (Qwen3.5), Gemma 3's pan-and-scan crops, chunked prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hsx.align import FINAL, AlignedSample, Collector, LayerGroup, teacher_forced
from hsx.data.images import VisionSpec
from hsx.engine.families import recurrent_kinds, window_plan
from hsx.engine.hf.engine import SamplingSettings, SpecSettings, _choose
from hsx.errors import HsxError


@dataclass
class VisionSample:
    """A sample of a vision-language target: its rows, and the positions every stored token ran at.
    ``sample.vision`` holds the shard's image columns (:func:`vision_columns`)."""

    sample: AlignedSample
    positions: torch.Tensor  # [3, N] for mRoPE models, else [N]: position of each of the sample's N tokens
    rope_delta: int | None  # mRoPE models: decode positions are prompt_len + t + rope_delta

    def __post_init__(self):
        self.sample.vision = vision_columns(self)


def vision_columns(vs: VisionSample) -> dict:
    """The image columns of a sample (hsx.shards.format.VISION_FIELDS)."""
    return {"rope_delta": vs.rope_delta,
            "mrope_positions": vs.positions.reshape(-1).to(torch.int32) if vs.positions.dim() == 2 else None}


def with_prompt_images(vs: VisionSample, prompt) -> VisionSample:
    """``vs`` with its prompt's image mask (0 on generated tokens) and per-image records added to its columns."""
    n = vs.sample.input_ids.numel()
    mask = torch.zeros(n, dtype=torch.uint8)
    mask[: len(prompt.vision.image_mask)] = torch.tensor(prompt.vision.image_mask, dtype=torch.uint8)
    vs.sample.vision["image_mask"] = mask
    vs.sample.vision["images"] = [{"source": im.source, "sha256": im.sha256, "width": im.size[0], "height": im.size[1],
                                   "grid": list(im.grid), "start": im.start, "num_tokens": im.num_tokens}
                                  for im in prompt.vision.images]
    return vs


def language_model(model):
    """The decoder a vision-language model runs its merged embeddings through (blocks in ``.layers``, ``.norm``)."""
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None)
    if lm is None or not hasattr(lm, "layers") or not hasattr(lm, "norm"):
        raise HsxError(f"vision-language target {type(model).__name__}: expected its decoder at "
                       "model.model.language_model with .layers and .norm")
    return lm


class _Hooks:
    """Forward hooks on the language model keeping the boundaries ``sources`` of the latest forward."""

    def __init__(self, lm, sources: Sequence, num_layers: int):
        self.lm, self.sources, self.num_layers = lm, tuple(dict.fromkeys(sources)), num_layers
        self.states: dict = {}
        self.handles: list = []

    def __enter__(self):
        blocks, norm, wanted = self.lm.layers, self.lm.norm, set(self.sources)
        # boundary b < L is what block b receives: on deepstack models, after the vision features are added
        for b in sorted(s for s in wanted if s != FINAL and 0 <= s < self.num_layers):
            self.handles.append(blocks[b].register_forward_pre_hook(self._keep(b, pre=True)))
        if self.num_layers in wanted:
            self.handles.append(norm.register_forward_pre_hook(self._keep(self.num_layers, pre=True)))
        if FINAL in wanted:
            self.handles.append(norm.register_forward_hook(self._keep(FINAL)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _keep(self, source, pre: bool = False):
        if pre:
            def hook(module, args):
                self.states[source] = args[0]
        else:
            def hook(module, args, output):
                self.states[source] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self, sources: Sequence) -> torch.Tensor:
        """Boundaries ``sources`` of the latest forward concatenated along the width, ``[B, q, len(sources) * W]``."""
        return torch.cat([self.states[s] for s in sources], -1)

    def columns(self, groups: Sequence[LayerGroup]) -> dict[str, torch.Tensor]:
        return {g.name: self.take(g.sources) for g in groups}


class VisionEngine:
    """Prefill, plain and speculative decoding of a vision-language target over :class:`hsx.data.render.VisionPrompt` s."""

    def __init__(self, model, groups: Sequence[LayerGroup], spec: VisionSpec, *, store_dtype: torch.dtype = torch.bfloat16,
                 draft_model=None, spec_settings: SpecSettings | None = None):
        from hsx.engine.hf.vision_drafts import VisionDrafts

        if draft_model is None and spec_settings is not None:
            raise HsxError("speculative settings given without a draft model")
        # layers with a recurrent state (Qwen3.5's Gated DeltaNet): never fed padding or rejected tokens
        self.recurrent = recurrent_kinds(model.config)
        if draft_model is not None:
            refuse_drafts(model.config, spec.model_type)
        # a draft model or EAGLE3 head, checked before the first forward
        self.drafts = None if draft_model is None else VisionDrafts(draft_model, model, spec_settings, spec.model_type)
        self.head = self.drafts is not None and self.drafts.head
        self.aux_sources = () if self.drafts is None else self.drafts.aux_sources
        self.model = model.eval()
        self.spec = spec
        self.groups = list(groups)
        self.store_dtype = store_dtype
        self.lm = language_model(model)
        self.num_layers = len(self.lm.layers)
        self.device = next(model.parameters()).device
        for g in self.groups:
            bad = [s for s in g.sources if s != FINAL and not 0 <= s <= self.num_layers]
            if bad:
                raise HsxError(f"layer group {g.name!r}: boundaries {bad} outside 0..{self.num_layers}")
        self.sources = [s for g in self.groups for s in g.sources]

    # ---- batch inputs ----------------------------------------------------------------------

    def _batch(self, prompts) -> dict:
        """Right-padded ids, mask, positions and pixels of ``prompts``; ``deltas [B]`` for mRoPE models."""
        dev, lengths = self.device, [len(p.input_ids) for p in prompts]
        ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : lengths[i]] = torch.tensor(p.input_ids, dtype=torch.long)
        mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
        ids, mask = ids.to(dev), mask.to(dev)
        with_images = [p.vision for p in prompts if p.vision.images]
        pixels = torch.cat([v.pixel_values for v in with_images]).to(dev, self.model.dtype) if with_images else None
        grid = None
        if self.spec.mrope and with_images:
            grid = torch.cat([v.image_grid_thw for v in with_images]).to(dev)
        extra = {} if pixels is None else {"pixel_values": pixels}
        if grid is not None:
            extra["image_grid_thw"] = grid
        if self.spec.bidirectional:  # Gemma 3: image tokens attend both ways inside their block; padding is type 0
            extra["token_type_ids"] = (ids == self.spec.image_token_id).long() * mask
        if self.spec.mrope:
            types = (ids == self.spec.image_token_id).int() * mask.int()
            positions, deltas = self.model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid,
                                                                attention_mask=mask)
            deltas = deltas.reshape(-1)
        else:
            positions, deltas = (mask.cumsum(1) - 1).clamp(min=0), None
        return {"ids": ids, "mask": mask, "positions": positions, "deltas": deltas, "lengths": lengths, "extra": extra}

    def _hooks(self, extra_sources: Sequence = ()) -> _Hooks:
        """Hooks keeping the groups' boundaries (and ``extra_sources``, e.g. a head's aux states) of each forward."""
        return _Hooks(self.lm, list(self.sources) + list(extra_sources), self.num_layers)

    def _decode_start(self, b: dict) -> torch.Tensor:
        """``[B]`` where each row's first completion token sits: its prompt length (+ rope_delta on mRoPE models)."""
        lengths = torch.tensor(b["lengths"], device=self.device)
        next_pos = lengths + (b["deltas"].to(self.device) if b["deltas"] is not None else 0)
        if self.spec.mrope:
            top = b["positions"].amax(dim=(0, 2)) + 1  # [B] largest prompt position + 1 (padding sits at 0)
            if not torch.equal(top, next_pos):
                raise HsxError(f"rope_delta does not continue the prompt's positions: {top.tolist()} vs {next_pos.tolist()}")
        return next_pos

    def _forward(self, ids, mask, positions, cache=None, **extra):
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                          use_cache=cache is not None, output_hidden_states=False, **extra)

    def _prompt_positions(self, b: dict, i: int) -> torch.Tensor:
        n = b["lengths"][i]
        return (b["positions"][:, i, :n] if self.spec.mrope else b["positions"][i, :n]).cpu()

    # ---- entry points ----------------------------------------------------------------------

    def prefill(self, prompts) -> list[VisionSample]:
        """Teacher-forced rows for every position of each prompt, in one batched forward."""
        if not prompts:
            return []
        b = self._batch(prompts)
        with torch.inference_mode(), _Hooks(self.lm, self.sources, self.num_layers) as hooks:
            self._forward(b["ids"], b["mask"], b["positions"], **b["extra"])
            cols = hooks.columns(self.groups)
        out = []
        for i, p in enumerate(prompts):
            n = b["lengths"][i]
            sample = teacher_forced(torch.tensor(p.input_ids), {k: c[i, :n] for k, c in cols.items()}, self.groups,
                                    self.store_dtype)
            delta = None if b["deltas"] is None else int(b["deltas"][i])
            out.append(with_prompt_images(VisionSample(sample, self._prompt_positions(b, i), delta), p))
        return out

    def generate(self, prompts, sampling: SamplingSettings) -> list[VisionSample]:
        """Decoding of every prompt in one batch until a stop token or ``max_new_tokens``: plain, or speculative
        when the engine has a draft (:mod:`hsx.engine.hf.vision_drafts`). On a target with recurrent layers each
        prompt is decoded alone, its sampling generator seeded with ``sampling.seed`` as a batch's is."""
        from transformers import DynamicCache

        if not prompts:
            return []
        if self.drafts is not None:
            from hsx.engine.hf.vision_drafts import generate_speculative

            return self._results(prompts, *generate_speculative(self, prompts, sampling))
        if self.recurrent and len(prompts) > 1:  # a decode step would feed a right-padded row's state its padding
            return [vs for p in prompts for vs in self.generate([p], sampling)]
        b = self._batch(prompts)
        batch, dev = len(prompts), self.device
        lengths = torch.tensor(b["lengths"], device=dev)
        next_pos = self._decode_start(b)
        generator = torch.Generator(device=dev).manual_seed(sampling.seed)
        collector = Collector(self.groups, self.store_dtype)
        rids = list(range(batch))
        windows = window_plan(self.model)
        # sliding layers (Gemma 3): every slot kept, the window applied by position in each step's mask
        cache = DynamicCache() if windows else DynamicCache(config=self.model.config)
        stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        done: dict[int, AlignedSample] = {}
        with torch.inference_mode(), self._hooks() as hooks:
            out = self._forward(b["ids"], b["mask"], b["positions"], cache, **b["extra"])
            last = out.logits[torch.arange(batch, device=dev), lengths - 1]  # [B, V]
            token = _choose(last, sampling, generator)  # [B]
            cols = hooks.columns(self.groups)
            for i in rids:
                collector.prefill(i, torch.tensor(prompts[i].input_ids), {k: c[i, : b["lengths"][i]] for k, c in cols.items()},
                                  int(token[i]))
            mask, n_out = b["mask"], 1
            self._retire(rids, token, n_out, stops, sampling, collector, done)
            while len(done) < batch:
                mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=dev)], 1)
                step_pos = (next_pos + n_out - 1)[:, None]  # [B, 1] the position of the token being fed
                positions = step_pos[None].expand(3, -1, -1) if self.spec.mrope else step_pos
                step_mask = mask
                if windows:  # slot j of a row holds position j in the prompt, next_pos + t for decode token t
                    width = b["ids"].shape[1]
                    key_pos = torch.cat([torch.arange(width, device=dev).expand(batch, -1),
                                         next_pos[:, None] + torch.arange(n_out, device=dev)], 1)  # [B, K]
                    step_mask = windows.masks(mask.bool()[:, None, :], step_pos, key_pos, self.model.dtype)
                out = self._forward(token[:, None], step_mask, positions, cache)
                nxt = _choose(out.logits[:, -1], sampling, generator)
                cols = hooks.columns(self.groups)
                for i in rids:
                    if i not in done:
                        collector.extend(i, {k: c[i] for k, c in cols.items()}, nxt[i : i + 1])
                token, n_out = nxt, n_out + 1
                self._retire(rids, token, n_out, stops, sampling, collector, done)
        return self._results(prompts, done, b)

    def _results(self, prompts, done: dict, b: dict) -> list[VisionSample]:
        """Each row's finished sample with the positions its tokens ran at, in prompt order."""
        result = []
        for i in range(len(prompts)):
            sample = done[i]
            n, p = sample.input_ids.numel(), b["lengths"][i]
            decode = torch.arange(p, n) + (int(b["deltas"][i]) if self.spec.mrope else 0)
            prompt_pos = self._prompt_positions(b, i)
            positions = torch.cat([prompt_pos, decode[None].expand(3, -1) if self.spec.mrope else decode], -1)
            delta = None if b["deltas"] is None else int(b["deltas"][i])
            result.append(with_prompt_images(VisionSample(sample, positions, delta), prompts[i]))
        return result

    @staticmethod
    def _retire(rids, token, n_out, stops, sampling, collector, done) -> None:
        """Finish the rows whose newest token is a stop token or whose completion reached ``max_new_tokens``."""
        is_stop = torch.isin(token, stops).tolist()
        for i in rids:
            if i in done:
                continue
            if is_stop[i] or n_out >= sampling.max_new_tokens:
                done[i] = collector.finish(i, n_out, "stop" if is_stop[i] else "length", speculative=False)


def refuse_drafts(config, model_type: str) -> None:
    """Speculative decoding is refused on a target (its ``config``) with recurrent layers: a verify step's rejected
    tokens would stay in their state (the text engine rolls states back; this batch does not)."""
    kinds = recurrent_kinds(config)
    if kinds:
        raise HsxError(f"vision-language target ({model_type}): speculative decoding is not run on targets with "
                       f"recurrent layers ({', '.join(map(repr, kinds))}): a verify step's rejected tokens would stay "
                       "in their state; decode without a draft")


def load_vision_target(path: str, dtype: torch.dtype, trust_remote_code: bool = False):
    """``(model, tokenizer, image_processor, spec)`` of a vision-language checkpoint; the image processor is
    its PIL backend (no torchvision needed)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    processor = AutoImageProcessor.from_pretrained(path, backend="pil", trust_remote_code=trust_remote_code)
    spec = VisionSpec.of(config, tokenizer, processor)  # refuses what hsx does not run, before the weights load
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer, processor, spec
