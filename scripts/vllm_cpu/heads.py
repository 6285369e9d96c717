"""hsx.demo.spec_models' draft heads rewritten in the formats vLLM 0.32 loads.

- EAGLE: SGLang's ``LlamaForCausalLMEagle`` head -> vLLM's: the target's architecture name
  (``LlamaForCausalLM``; vLLM makes it ``EagleLlamaForCausalLM``), no ``fc.bias`` (vLLM's ``fc`` has
  none; the demo's is zero) and no ``lm_head`` (vLLM shares the target's, which the demo's copies).
- EAGLE3: vLLM creates ``d2t`` only when the draft vocabulary is smaller than the target's, so the
  demo's same-size permuted vocabulary is folded into ``lm_head`` (row of target id ``t`` = row of
  draft id ``d`` with ``d + d2t[d] = t``) and ``d2t`` / ``t2d`` dropped. The aux ids become
  ``[i + 1 for i in ids]``: the demo's ids ``[1, 3, 5]`` mean boundaries 2, 4, 6 under SGLang's
  rule, and vLLM reads an id as the boundary itself, so the head is fed the states it was built on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _rewrite(dst: Path, config: dict, weights: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def vllm_eagle(src: Path, dst: Path) -> Path:
    config = json.loads((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    assert float(weights.pop("fc.bias").abs().max()) == 0.0, "a non-zero fc.bias has no place in vLLM's EAGLE head"
    weights.pop("lm_head.weight")
    config["architectures"] = ["LlamaForCausalLM"]
    return _rewrite(dst, config, weights)


def vllm_eagle3(src: Path, dst: Path) -> Path:
    config = json.loads((src / "config.json").read_text())
    weights = load_file(str(src / "model.safetensors"))
    d2t, lm_head = weights.pop("d2t"), weights.pop("lm_head.weight")
    weights.pop("t2d")
    target_ids = torch.arange(d2t.numel()) + d2t
    assert sorted(target_ids.tolist()) == list(range(d2t.numel())), "d2t is not a permutation of the vocabulary"
    folded = torch.empty_like(lm_head)
    folded[target_ids] = lm_head
    weights["lm_head.weight"] = folded
    eagle = dict(config["eagle_config"])
    eagle["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    config["eagle_config"] = eagle
    return _rewrite(dst, config, weights)


def vllm_heads(models) -> tuple[Path, Path]:
    """(EAGLE head, EAGLE3 head) for vLLM next to ``models``' own."""
    return (vllm_eagle(models.eagle, models.root / "vllm-eagle"),
            vllm_eagle3(models.eagle3, models.root / "vllm-eagle3"))
