"""``--engine stub``: hands back the rows an existing hsx output stored for the same prompt.

It runs no model. Everything hsx asks of an engine is here, stated by the runner contract
(:mod:`hsx.engine.contract`): the tokenizer, columns, config and shape of the model the rows came
from, the metadata records, and ``stream`` over windows of rendered prompts. The source is named
with ``--engine-arg rows_from=DIR``; its samples are matched to prompts by their prompt tokens.
"""

from __future__ import annotations

import torch

from hsx.align import AlignedSample, ModelShape, parse_layers
from hsx.config import ExtractConfig
from hsx.engine.contract import Runner
from hsx.errors import HsxError, SampleError
from hsx.shards.reader import open_shards


class StubRunner(Runner):
    name = "stub"

    @classmethod
    def check_config(cls, cfg: ExtractConfig) -> None:
        if set(cfg.engine_args) != {"rows_from"}:
            raise HsxError(f"--engine stub takes one engine argument, rows_from=DIR; got {sorted(cfg.engine_args)}")

    def __init__(self, cfg: ExtractConfig):
        from transformers import AutoConfig, AutoTokenizer

        self.rows_from = cfg.engine_args["rows_from"]
        self.source = open_shards(self.rows_from)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.model_config = AutoConfig.from_pretrained(cfg.model)
        self.shape = ModelShape.from_config(self.model_config)
        self.groups = parse_layers(cfg.layers, self.shape, cfg.eagle3_layer_ids)
        self.context_length = self.model_config.max_position_embeddings
        have = {g["name"]: g["sources"] for g in self.source.metadata["layers"]}
        missing = [g.name for g in self.groups if have.get(g.name) != [*g.sources]]
        if missing or self.source.metadata["mode"] != cfg.mode:
            raise HsxError(f"{self.rows_from} has no rows for columns {missing} in mode {cfg.mode}")
        # the source's samples by their prompt tokens
        self.by_prompt = {tuple(s.input_ids[:s.prompt_len].tolist()): i for i, s in enumerate(self.source)}

    def describe(self) -> dict:
        return {"name": self.name, "rows_from": str(self.rows_from)}

    def describe_speculative(self) -> dict | None:
        return self.source.metadata.get("speculative")

    def stream(self, prompts):
        for prompt in reversed(prompts):  # any order: the run puts samples back in window order
            index = self.by_prompt.get(tuple(prompt.input_ids))
            if index is None:
                yield prompt, SampleError(prompt.sample_id, f"no sample of {self.rows_from} has this prompt")
                continue
            s = self.source[index]
            hidden = {g.name: s.hidden(g.name).clone() for g in self.groups}
            yield prompt, AlignedSample(s.input_ids.to(torch.int64), s.prompt_len, hidden, 0,
                                        None if s.accept_lens is None else torch.as_tensor(s.accept_lens),
                                        s.finish_reason)
