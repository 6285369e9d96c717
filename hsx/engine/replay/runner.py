"""The engine of a run over an hsx output's tokens: the configured engine's prefill, checked against the source.

Each prompt (:func:`hsx.data.render.stored_prompt`) holds a sample the source output stored. Its
tokens are fed teacher-forced as far as the source's rows reach (generate mode: positions
``0..N-2``, the last token is not fed; prefill: ``0..N-1``), by the engine's prefill path and its
scheduling (longest first within a window, ``--batch-size``, ``--max-batch-tokens``). The sample
handed back carries the source's tokens, ``prompt_len``, finish reason and accept lengths, so the
record :func:`hsx.run.core.make_record` makes of it, in the source's mode and under its keep rule,
has the source's fields and its rows at the source's positions.

Before a sample is handed back, every source both outputs hold is compared with the source's
rows of that sample (:mod:`hsx.compare.agreement`). A disagreement stops the run, naming the
sample and the column: it is no fault of one input row but a sign that the model's weights
(which the config hash does not cover) or the source's rows are not what its metadata says, and
error records would let such a run finish with every sample an error.

The columns the run will share with the source are worked out before any weight loads, with
``--eagle3-layer-ids`` read by the rule of the engine that captures them (vLLM: boundary = id; the
others: + 1, :func:`planned_groups`), and again with the columns the engine made.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from hsx.align import EAGLE3, AlignedSample, LayerGroup, ModelShape, parse_layers
from hsx.config import ExtractConfig
from hsx.compare.agreement import Shared, agreement_tolerance, disagreement, shared_sources
from hsx.config import differences
from hsx.data.stored import adopt_source
from hsx.engine.contract import Runner
from hsx.errors import HsxError, SampleError
from hsx.heads.layer_ids import IdReading, eagle3_ids_as_boundaries
from hsx.shards.format import config_matches, dtype_of
from hsx.shards.positions import covered_rows


class StoredTokensRunner(Runner):
    """The engine ``build`` makes for ``cfg`` in prefill mode, over the samples of the hsx output ``cfg.dataset``."""

    def __init__(self, cfg: ExtractConfig, build, reading: IdReading):
        from hsx.shards.reader import open_shards

        self.where, self.mode, self.layers = cfg.dataset, cfg.mode, cfg.layers
        self.source = open_shards(cfg.dataset)
        meta = self.source.metadata
        _check_adopted(cfg, meta)
        shape = _check_model(cfg, meta.get("model") or {})
        # checked before any weight loads, with the columns the engine will make, then again with the ones it made
        self.shared = self._shared(planned_groups(cfg, shape, reading), meta)
        self.inner = build(dataclasses.replace(cfg, mode="prefill", keep="all"))
        self.shared = self._shared(self.inner.groups, meta)
        self.groups, self.shape = self.inner.groups, self.inner.shape
        self.source_layers = [LayerGroup.from_description(g) for g in meta["layers"]]
        self.tokenizer, self.context_length = self.inner.tokenizer, self.inner.context_length
        self.model_config, self.name = self.inner.model_config, self.inner.name
        stored = str(dtype_of(cfg.dtype)).removeprefix("torch.")  # what the engine hands over (lossy: bfloat16)
        self.tol = agreement_tolerance(meta, self.inner.describe().get("compute_dtype"), stored)
        self.speculative = meta.get("speculative")

    def _shared(self, groups, meta) -> list[Shared]:
        shared = shared_sources(groups, meta["layers"], self.where)
        if not shared:
            have = ", ".join(g["name"] for g in meta["layers"])
            raise HsxError(f"--layers {self.layers!r} shares no column with {self.where} ({have}): add one of them, "
                           "so that the pass over its tokens can be checked against its rows")
        return shared

    def describe(self) -> dict:
        return self.inner.describe()

    def describe_speculative(self) -> dict | None:
        """The source's: its tokens and accept lengths are what that decoding made."""
        return self.speculative

    def watch_tokens(self, callback) -> None:
        self.inner.watch_tokens(callback)

    def stream(self, prompts) -> Iterator[tuple]:
        """``(prompt, sample)`` for a window of stored prompts as each finishes, each checked against the source."""
        by_id = {p.sample_id: p for p in prompts}
        fed = [_fed(p, int(covered_rows(len(p.tokens), self.mode))) for p in prompts]
        for f, sample in self.inner.stream(fed):
            prompt = by_id[f.sample_id]
            if not isinstance(sample, SampleError):
                sample = _as_source(prompt, sample)
                self._check(prompt, sample)
            yield prompt, sample

    def _check(self, prompt, sample: AlignedSample) -> None:
        sample.wait()  # (on CUDA the host copies may still be in flight)
        src = self.source[prompt.sample_id]
        pos = src.positions
        for sh in self.shared:
            a, b = self._span(sh.source_name, sh.source_part, self.source_layers)
            stored = src.hidden(sh.source_name)[:, a:b]
            if stored.shape[0] != len(pos):
                raise HsxError(f"{self._sample(prompt)}, {sh.label} of {self.where}: {stored.shape[0]} rows for the "
                               f"{len(pos)} positions its keep rule gives")
            a, b = self._span(sh.name, sh.part, self.groups)
            fresh = sample.hidden[sh.name][pos, a:b]
            found = disagreement(stored, fresh, self.tol)
            if found is not None:
                raise HsxError(self._mismatch(prompt, sh, found, pos))

    def _span(self, name: str, part: int, groups) -> tuple[int, int]:
        """Where source ``part`` of column ``name`` sits in its rows (``final`` is narrower on hyper-connection models)."""
        group = next(g for g in groups if g.name == name)
        return self.shape.spans(group.sources)[part]

    def _sample(self, prompt) -> str:
        return f"sample {prompt.sample_id!r} (source row {prompt.source_index})"

    def _mismatch(self, prompt, sh: Shared, found: tuple[int, int, float], pos: torch.Tensor) -> str:
        bad, worst, rel = found
        return (f"{self._sample(prompt)}, {sh.label} of {self.where}: {bad} of {len(pos)} rows differ from this "
                f"run's teacher-forced pass over the same tokens (worst at position {int(pos[worst])}: relative error "
                f"{rel:.3g}, limit {self.tol.rel:.3g}). The source's rows or the model's weights are not what its "
                f"metadata says; `hsx verify --recompute {self.where}` diagnoses its rows")


def planned_groups(cfg: ExtractConfig, shape: ModelShape, reading: IdReading) -> list[LayerGroup]:
    """The columns ``cfg``'s engine will make, known before it loads: ``--eagle3-layer-ids`` read by the rule of
    the engine that captures them (:func:`hsx.heads.layer_ids.eagle3_ids_as_boundaries` with ``reading``, the ``id_reading`` of
    the runner ``build`` makes: vLLM
    boundary = id, the others + 1), not by one rule for all (a run over an output has no draft model)."""
    groups = parse_layers(cfg.layers, shape, None)
    if cfg.eagle3_layer_ids is None:
        return groups
    bounds, rule = eagle3_ids_as_boundaries(cfg.eagle3_layer_ids, reading.rule, shape.num_layers)
    raw = tuple(int(i) for i in cfg.eagle3_layer_ids)
    return [LayerGroup(EAGLE3, tuple(sorted(bounds)) if reading.rule == "vllm" else bounds, g.width, raw, rule)
            if g.name == EAGLE3 else g for g in groups]


def _fed(prompt, rows: int):
    """The prompt an engine's prefill is given: the tokens whose rows the source holds (the loss mask is not read)."""
    return dataclasses.replace(prompt, input_ids=prompt.tokens[:rows], loss_mask=[0] * rows)


def _as_source(prompt, sample: AlignedSample) -> AlignedSample:
    """The prefill's rows with the source's tokens, ``prompt_len``, finish reason and accept lengths."""
    accept = None if prompt.accept_lens is None else torch.tensor(prompt.accept_lens, dtype=torch.int16)
    return AlignedSample(torch.tensor(prompt.tokens, dtype=torch.int64), prompt.prompt_len, sample.hidden, 0, accept,
                         prompt.finish_reason, prompt.verify_steps, ready=sample.ready)


def _check_adopted(cfg: ExtractConfig, source_meta: dict) -> None:
    """``cfg`` must hold the source's mode, keep and sampling fields (``hsx extract`` puts them there)."""
    adopted = adopt_source(cfg, source_meta)
    if adopted != cfg:
        diff = "; ".join(differences(cfg.to_dict(), adopted.to_dict()))
        raise HsxError(f"a run over the hsx output {cfg.dataset} keeps its {diff} (this run -> the source); "
                       "hsx extract takes them from it, and so does hsx.data.stored.adopt_source(cfg)")


def _check_model(cfg: ExtractConfig, recorded: dict) -> ModelShape:
    """The model's config must be the one the source records (``model.config_sha256``), as ``hsx verify
    --recompute`` checks it: its tokens are that model's. Read before any weight loads."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise HsxError(f"cannot read the config of model {cfg.model!r}: {e}") from None
    if not recorded.get("config_sha256") or not config_matches(config, recorded):
        raise HsxError(f"--model {cfg.model!r} has a different config from the one {cfg.dataset} was made with "
                       f"(config_sha256 {recorded.get('config_sha256')!r} recorded for {recorded.get('path')!r}); a run "
                       "over its tokens needs that model")
    return ModelShape.from_config(config)
