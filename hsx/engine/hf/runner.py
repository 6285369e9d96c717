"""The transformers engine behind the runner contract (:mod:`hsx.engine.contract`): load, plan columns, schedule windows."""

from __future__ import annotations

from typing import Iterator

import torch

from hsx.align import EAGLE3, LayerGroup, ModelShape, parse_layers
from hsx.config import ExtractConfig
from hsx.device import compute_dtype, resolve_device
from hsx.engine.contract import Runner, stop_token_ids
from hsx.engine.hf.batching import prefill_batches
from hsx.errors import HsxError
from hsx.heads.layer_ids import HF_READING, eagle3_ids_from_config, resolve_head_layers
from hsx.shards.format import dtype_of


class HFRunner(Runner):
    """The transformers engine driven over rendered prompts."""

    name = "hf"
    id_reading = HF_READING

    @classmethod
    def check_config(cls, cfg: ExtractConfig) -> None:
        if cfg.speculative and cfg.draft_model is None:
            raise HsxError("--spec-* options need --draft-model with the hf engine")
        if cfg.engine_args:
            raise HsxError(f"engine_args {sorted(cfg.engine_args)} are sglang.Engine or vllm.LLM arguments; the hf engine takes none")
        if cfg.spec_algorithm is not None:
            raise HsxError("--spec-algorithm names SGLang's or vLLM's algorithm (--engine sglang or vllm); the hf engine runs --draft-model")

    def __init__(self, cfg: ExtractConfig):
        self.check_config(cfg)  # also when built directly, not through the registry
        from transformers import AutoConfig, AutoTokenizer

        from hsx.engine.families import load_causal_lm
        from hsx.engine.hf.engine import HFEngine, SamplingSettings, SpecSettings, load_draft

        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = compute_dtype(cfg.model_dtype, self.device)
        remote = cfg.trust_remote_code
        self.vision = None  # (VisionSpec, image processor) of a vision-language target
        try:
            if getattr(AutoConfig.from_pretrained(cfg.model, trust_remote_code=remote), "vision_config", None) is not None:
                self._start_vision(cfg)
                return
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=remote)
            model = load_causal_lm(cfg.model, self.dtype, remote, what="target model")
            draft = None
            if cfg.draft_model:
                draft = load_draft(cfg.draft_model, model, self.dtype, remote)
        except (OSError, ValueError) as e:
            raise HsxError(f"cannot load model {cfg.model!r}"
                           + (f" / draft {cfg.draft_model!r}" if cfg.draft_model else "") + f": {e}") from None
        model.to(self.device).eval()
        if draft is not None:
            draft.to(self.device).eval()
        self.model_config = model.config
        self.shape = ModelShape.from_config(model.config)
        self._plan_groups(cfg, getattr(model.config, "model_type", None), draft)
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.spec = SpecSettings(*cfg.spec_settings()) if cfg.speculative else None
        self.engine = HFEngine(model, self.groups, draft_model=draft, spec=self.spec, store_dtype=dtype_of(cfg.dtype),
                               prefill_chunk=cfg.prefill_chunk)
        self.sampling = SamplingSettings(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
            stop_token_ids=stop_token_ids(cfg.model, self.tokenizer, getattr(model, "generation_config", None)),
        )

    def _plan_groups(self, cfg: ExtractConfig, model_type: str | None, draft) -> None:
        """The run's layer groups, and an EAGLE3 head's ids resolved (hsx.heads.layer_ids), recorded with the run."""
        from transformers import AutoConfig

        ids = cfg.eagle3_layer_ids
        self.head_layers = None
        if getattr(draft, "head_config", None) is not None:
            self.head_layers = resolve_head_layers(draft.head_config, self.id_reading, model_type, self.shape.num_layers)
        if ids is None and cfg.draft_model:
            ids = eagle3_ids_from_config(AutoConfig.from_pretrained(cfg.draft_model, trust_remote_code=cfg.trust_remote_code))
        self.groups: list[LayerGroup] = parse_layers(cfg.layers, self.shape, ids)
        if self.head_layers is not None and self.head_layers.boundaries is not None and (
                cfg.eagle3_layer_ids is None or tuple(cfg.eagle3_layer_ids) == self.head_layers.head_ids):
            # the column holds what the head reads, by the rule its ids follow (not parse_layers' generic + 1)
            self.groups = [_head_group(g, self.head_layers) if g.name == EAGLE3 else g for g in self.groups]

    def _start_vision(self, cfg: ExtractConfig) -> None:
        """A vision-language target (hsx.engine.hf.vision): what it does not run is refused before it loads."""
        from hsx.engine.hf.engine import SamplingSettings, SpecSettings, load_draft
        from hsx.engine.hf.vision import VisionEngine, load_vision_target, refuse_drafts

        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        kind = config.model_type
        self.spec = SpecSettings(*cfg.spec_settings()) if cfg.speculative else None
        if self.spec is not None and self.spec.topk > 1:
            raise HsxError(f"vision-language target ({kind}): draft trees (--spec-topk {self.spec.topk}) are not run on "
                           "vision-language targets; draft a chain (--spec-topk 1)")
        if cfg.prefill_chunk is not None:
            raise HsxError(f"vision-language target ({kind}): --prefill-chunk is not run on vision-language targets "
                           "(each prompt is one forward with its images)")
        if cfg.draft_model is not None:
            refuse_drafts(config, kind)
        model, self.tokenizer, processor, spec = load_vision_target(cfg.model, self.dtype, cfg.trust_remote_code)
        model.to(self.device)
        try:
            draft = None if cfg.draft_model is None else load_draft(cfg.draft_model, model, self.dtype,
                                                                    cfg.trust_remote_code).to(self.device).eval()
        except (OSError, ValueError) as e:
            raise HsxError(f"cannot load draft {cfg.draft_model!r}: {e}") from None
        self.vision = (spec, processor)
        self.model_config = model.config
        self.shape = ModelShape.from_config(model.config.get_text_config(decoder=True))
        self._plan_groups(cfg, kind, draft)
        self.context_length = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.engine = VisionEngine(model, self.groups, spec, store_dtype=dtype_of(cfg.dtype), draft_model=draft,
                                   spec_settings=self.spec)
        self.sampling = SamplingSettings(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
            stop_token_ids=stop_token_ids(cfg.model, self.tokenizer, getattr(model, "generation_config", None)),
        )

    def describe_vision(self) -> dict:
        """The metadata's ``vision`` record (docs/FORMAT.md, "Images")."""
        from hsx.engine.hf.vision_drafts import IMAGE_TOKEN_DRAFT_INPUT

        spec = self.vision[0]
        return {"model_type": spec.model_type, "image_token_id": spec.image_token_id, "image_token": spec.image_token,
                "image_processor": type(self.vision[1]).__name__, "mrope": spec.mrope,
                "boundary_0": "the merged text and vision embeddings the first block receives",
                "boundaries": "boundary b < L is the input of block b (after any deepstack add)",
                "deepstack": {"blocks": spec.deepstack,
                              "side": "after the add: boundaries 1..blocks hold what the next block receives "
                                      "(transformers' hidden_states and SGLang's capture are before it)"}
                if spec.deepstack else None,
                "image_hash": "sha256 of 'WIDTHxHEIGHT:' + the RGB pixels",
                "draft_at_image_tokens": IMAGE_TOKEN_DRAFT_INPUT if self.spec is not None else None}

    def describe(self) -> dict:
        import transformers

        return {"name": "hf", "version": transformers.__version__, "torch": torch.__version__,
                "compute_dtype": str(self.dtype).removeprefix("torch."), "device_type": self.device.type}

    def describe_speculative(self) -> dict | None:
        if self.spec is None:
            return None
        algorithm = "EAGLE3" if getattr(self.engine, "head", False) else "draft-model"
        out = {"algorithm": algorithm, "draft_model": self.cfg.draft_model, "num_steps": self.spec.num_steps,
               "topk": self.spec.topk, "num_draft_tokens": self.spec.num_draft_tokens,
               "tree": self.spec.topk > 1}
        if self.head_layers is not None:
            out["aux_layers"] = {**self.head_layers.describe(), "boundaries": list(self.engine.aux_sources)}
        return out

    def watch_tokens(self, callback) -> None:
        if self.vision is None:  # the vision-language path reports per finished sample
            self.engine.on_tokens = callback

    def run(self, prompts) -> list:
        """One sample per prompt, in order, from one batch."""
        requests = [(p.sample_id, torch.tensor(p.input_ids, dtype=torch.int64)) for p in prompts]
        if self.cfg.mode == "prefill":
            return self.engine.prefill(requests)
        return self.engine.generate(requests, self.sampling)

    def stream(self, prompts) -> Iterator[tuple]:
        """``(prompt, sample)`` for a window of prompts, as each finishes.

        Prefill: longest first, forwards of at most ``batch_size`` sequences and ``max_batch_tokens``
        padded tokens. Generate: continuous batching over ``batch_size`` rows, requests admitted in
        window order (completion lengths, not prompt lengths, decide when rows free up), each
        admission's prefill within ``max_batch_tokens``.
        """
        cfg = self.cfg
        if self.vision is not None:  # batches of batch_size in window order, each one forward or one decode loop
            for i in range(0, len(prompts), cfg.batch_size):
                batch = prompts[i : i + cfg.batch_size]
                done = self.engine.prefill(batch) if cfg.mode == "prefill" else self.engine.generate(batch, self.sampling)
                yield from zip(batch, (vs.sample for vs in done), strict=True)
            return
        if self.engine.on_tokens is not None:
            generate = cfg.mode == "generate"
            self.engine.on_tokens(queued=sum(len(p.input_ids) for p in prompts),
                                  budget=len(prompts) * cfg.max_new_tokens if generate else 0)
        if cfg.mode == "prefill":
            lengths = [len(p.input_ids) for p in prompts]
            for batch in prefill_batches(lengths, cfg.batch_size, cfg.max_batch_tokens):
                chosen = [prompts[i] for i in batch]
                yield from zip(chosen, self.run(chosen))
            return
        by_id = {p.sample_id: p for p in prompts}
        requests = [(p.sample_id, torch.tensor(p.input_ids, dtype=torch.int64)) for p in prompts]
        for rid, sample in self.engine.stream(requests, self.sampling, slots=cfg.batch_size,
                                              max_prefill_tokens=cfg.max_batch_tokens):
            yield by_id[rid], sample


def _head_group(group: LayerGroup, layers) -> LayerGroup:
    """The ``eagle3`` column of a run drafting with an EAGLE3 head: the boundaries its ids name by their rule."""
    unit = group.width // len(group.sources)
    return LayerGroup(EAGLE3, tuple(layers.boundaries), unit * len(layers.boundaries), layers.head_ids, layers.note())
