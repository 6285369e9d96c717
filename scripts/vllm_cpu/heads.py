"""hsx.demo.spec_models' draft heads rewritten in the formats vLLM 0.32 loads, by ``hsx export vllm-head``.

:func:`hsx.heads.vllm_head.convert_vllm_head` does the rewriting (its docstring and docs/VLLM.md say
what changes and why):

- EAGLE: SGLang's ``LlamaForCausalLMEagle`` head -> the draft's architecture name
  (``LlamaForCausalLM``; vLLM makes it ``EagleLlamaForCausalLM``), no ``fc.bias`` (vLLM's ``fc`` has
  none; the demo's is zero), no ``lm_head`` or ``embed_tokens`` (vLLM then shares the target's, as
  SGLang does).
- EAGLE3: the demo's same-size permuted vocabulary folded into ``lm_head`` (vLLM creates ``d2t`` only
  when the draft vocabulary is smaller than the target's) and ``d2t`` / ``t2d`` dropped; the aux ids
  ``[1, 3, 5]`` (boundaries 2, 4, 6 by SGLang's rule) become vLLM's ``[2, 4, 6]``, and the head is
  marked ``"hsx": {"aux_layer_ids_rule": "vllm", "aux_boundaries": [2, 4, 6]}``.
"""

from __future__ import annotations

from pathlib import Path

from hsx.heads.vllm_head import convert_vllm_head


def vllm_eagle(src: Path, dst: Path, target: Path) -> Path:
    convert_vllm_head(src, dst, model=str(target), overwrite=True)
    return dst


def vllm_eagle3(src: Path, dst: Path, target: Path) -> Path:
    convert_vllm_head(src, dst, model=str(target), overwrite=True)
    return dst


def vllm_heads(models) -> tuple[Path, Path]:
    """(EAGLE head, EAGLE3 head) for vLLM next to ``models``' own."""
    return (vllm_eagle(models.eagle, models.root / "vllm-eagle", models.target),
            vllm_eagle3(models.eagle3, models.root / "vllm-eagle3", models.target))
