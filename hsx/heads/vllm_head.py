"""``hsx export vllm-head``: an EAGLE3 or EAGLE draft head in SGLang's format rewritten in the one vLLM 0.32 loads.

What vLLM 0.32 reads, from its loaders (``vllm/model_executor/models/llama_eagle3.py``, ``llama_eagle.py``,
``vllm/transformers_utils/configs/eagle.py``, ``v1/spec_decode/llm_base_proposer.py``) and how the source's
meaning in SGLang 0.5.23 is kept:

EAGLE3 (``LlamaForCausalLMEagle3``, SpecForge's files; vLLM keeps the architecture name):

- aux layer ids: vLLM reads ``eagle_aux_hidden_state_layer_ids`` (the top level first, then
  ``eagle_config``) as boundaries (id ``i`` = the input of layer ``i``); SGLang reads id ``i`` as boundary
  ``i + 1`` for most targets (:func:`hsx.heads.layer_ids.sglang_boundaries`). The head's boundaries,
  by the rule its ``hsx`` marker names (SGLang's when it has none), are written as vLLM's ids, in
  ``eagle_config`` only, and the result is marked ``"vllm"``.
- vocabulary: vLLM creates ``d2t`` (``draft_id_to_target_id``) only when ``draft_vocab_size`` differs
  from the target's vocabulary; a same-size head's ``d2t`` then has no place and the load fails. A
  same-size ``d2t`` that is a permutation is folded into ``lm_head`` (row of target id ``t`` = row of
  draft id ``d`` with ``d + d2t[d] = t``) and dropped; a smaller draft vocabulary keeps its ``d2t`` (each
  draft id to a distinct target id). ``t2d`` is used by neither engine and is dropped.
- ``embed_tokens``: SGLang drafts with the target's embedding; vLLM uses a head's own one when the
  checkpoint has it and it differs from the target's, so it is dropped (vLLM then shares the target's).
- ``fc`` has no bias in vLLM: a zero ``fc.bias`` is dropped, any other refused.

EAGLE (``LlamaForCausalLMEagle``): vLLM names its EAGLE model after the draft's architecture
(``LlamaForCausalLM`` -> ``EagleLlamaForCausalLM``), its ``fc`` has no bias, and it shares the target's
``lm_head`` and embedding when the checkpoint has none, as SGLang always does: the architecture is
renamed, a zero ``fc.bias``, ``lm_head`` and ``embed_tokens`` are dropped, the result marked ``"vllm"``.

Everything else is copied as it is; a missing tensor, one neither engine reads (named), a shape that
does not match the config, or an option the two engines would read differently is refused with the
reason. Weights are read and written with safetensors only.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hsx.heads.load import EAGLE3_ARCH, EAGLE_ARCH, aux_layer_ids, head_kind
from hsx.heads.layer_ids import (VLLM_READING, BOUNDARIES_KEY, MARKER, RULE_KEY, head_marker, ids_by_rule, resolve_head_layers,
                                  sglang_boundaries)
from hsx.errors import HsxError

EAGLE3_LAYER = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
                "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
                "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
                "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight")
EAGLE_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# config options the two engines read differently (or only one reads): hsx cannot say which the head was built for
EAGLE3_REFUSED = {
    "norm_before_residual": "vLLM normalises the hidden input before the residual, SGLang's LlamaForCausalLMEagle3 after",
    "fc_norm": "per-chunk aux norms, which hsx does not convert",
    "use_aux_norm": "per-chunk aux norms, which hsx does not convert",
    "tie_word_embeddings": "an lm_head tied to the embedding",
    "attention_bias": "attention biases, which hsx does not convert",
}
EAGLE_REFUSED = {"attention_bias": "attention biases, which hsx does not convert"}


@dataclass
class VllmHead:
    """What :func:`convert_vllm_head` wrote."""

    kind: str  # "eagle3" or "eagle"
    src: Path
    dst: Path
    source_rule: str | None = None  # the rule the source's ids follow (EAGLE3)
    source_ids: list[int] | None = None
    ids: list[int] | None = None  # vLLM's ids written (= boundaries)
    boundaries: list[int] | None = None
    folded: bool = False  # a same-size d2t folded into lm_head
    kept_d2t: bool = False  # a smaller draft vocabulary: d2t kept
    dropped: list[str] = field(default_factory=list)

    def describe(self) -> str:
        done = [f"{self.dst}: vLLM {self.kind.upper()} head from {self.src}"]
        if self.kind == "eagle3":
            done.append(f"aux layer ids {self.source_ids} ({self.source_rule} rule) = boundaries {self.boundaries} -> "
                        f"vLLM ids {self.ids}")
            done.append("same-size d2t folded into lm_head" if self.folded else
                        "d2t kept (smaller draft vocabulary)" if self.kept_d2t else "lm_head as it was (no d2t)")
        if self.dropped:
            done.append(f"dropped {', '.join(self.dropped)}")
        return "; ".join(done)


def _fail(src: Path, why: str) -> HsxError:
    return HsxError(f"cannot convert {str(src)!r} for vLLM: {why}")


def read_head(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A head directory's ``config.json`` and every tensor of its ``*.safetensors`` files."""
    from safetensors import safe_open

    if not (src / "config.json").is_file():
        raise _fail(src, "no config.json")
    config = json.loads((src / "config.json").read_text())
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise _fail(src, "no *.safetensors weights (hsx reads no pickled checkpoints)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if k in weights:
                    raise _fail(src, f"tensor {k!r} is in two weight files")
                weights[k] = sf.get_tensor(k)
    return config, weights


def _target(model: str | None, trust_remote_code: bool):
    if model is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise HsxError(f"--model {model!r}: cannot read its config: {e}") from None


def _check_keys(src: Path, weights: dict, required: set[str], optional: set[str], why_unexpected: dict | None = None):
    missing = sorted(required - set(weights))
    unexpected = sorted(set(weights) - required - optional)
    if missing:
        raise _fail(src, f"missing tensors {missing}")
    if unexpected:
        notes = [f"{k} ({(why_unexpected or {}).get(k)})" if (why_unexpected or {}).get(k) else k for k in unexpected]
        raise _fail(src, f"tensors neither engine reads in this head: {notes}")


def _check_shape(src: Path, weights: dict, name: str, shape: tuple) -> None:
    if name in weights and tuple(weights[name].shape) != tuple(shape):
        raise _fail(src, f"{name} has shape {tuple(weights[name].shape)}, its config makes it {tuple(shape)}")


def _drop_zero_bias(src: Path, weights: dict, dropped: list[str]) -> None:
    bias = weights.pop("fc.bias", None)
    if bias is not None:
        if bool(bias.abs().max() != 0):
            raise _fail(src, f"fc.bias is not zero (largest |value| {float(bias.abs().max()):.3g}); vLLM's fc has no "
                             "bias, so the head would compute something else")
        dropped.append("fc.bias (zero)")


def _refused_options(src: Path, config: dict, refused: dict) -> None:
    eagle = config.get("eagle_config") or {}
    on = [k for k in refused if config.get(k) or eagle.get(k)]
    if on:
        raise _fail(src, "; ".join(f"{k} is set: {refused[k]}" for k in on))


def _vocab(src: Path, config: dict, target) -> int:
    V = int(config.get("vocab_size") or 0)
    if target is not None:
        tv = int(target.get_text_config(decoder=True).vocab_size)
        if V and V != tv:
            raise _fail(src, f"vocab_size {V}, the target's vocabulary is {tv}")
        V = tv
    if not V:
        raise _fail(src, "no vocab_size in config.json (give --model TARGET)")
    return V


def _convert_eagle3(src: Path, config: dict, weights: dict, target, result: VllmHead) -> tuple[dict, dict]:
    _refused_options(src, config, EAGLE3_REFUSED)
    eagle = dict(config.get("eagle_config") or {})
    if eagle.get("use_aux_hidden_state", True) is False or config.get("use_aux_hidden_state") is False:
        raise _fail(src, "use_aux_hidden_state is false: not an EAGLE3 head over the target's aux states")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise _fail(src, f"num_hidden_layers = {config.get('num_hidden_layers')}; SGLang's EAGLE3 head has one "
                         "layer (midlayer)")
    marker = head_marker(config)
    if target is not None:
        tcfg = target.get_text_config(decoder=True)
        model_type, L = getattr(target, "model_type", None), int(tcfg.num_hidden_layers)
        try:
            layers = resolve_head_layers(config, VLLM_READING, model_type, L, unmarked_rule="sglang")
        except HsxError as e:
            raise _fail(src, str(e)) from None
        if layers.head_ids is None:
            bounds = sglang_boundaries(None, model_type, L)
            result.source_ids, result.source_rule = None, "SGLang default"
        else:
            bounds = layers.boundaries
            result.source_ids, result.source_rule = list(layers.head_ids), layers.rule
        result.boundaries, result.ids = list(bounds), ids_by_rule(bounds, "vllm", model_type, L)
    elif marker is not None and marker.get(BOUNDARIES_KEY) is not None and aux_layer_ids(config) is not None:
        # marked by hsx with the boundaries its ids name (SGLang's rule for this target): they say it all
        result.source_ids, result.source_rule = aux_layer_ids(config), marker[RULE_KEY]
        result.boundaries = result.ids = [int(b) for b in marker[BOUNDARIES_KEY]]
        if len(result.boundaries) != len(result.source_ids) or min(result.boundaries) < 0:
            raise _fail(src, f"its hsx marker's {BOUNDARIES_KEY} {result.boundaries} do not fit its ids "
                             f"{result.source_ids}")
    else:
        raise _fail(src, "it records no boundaries (hsx marker aux_boundaries) beside its ids, so they follow "
                         "SGLang's rule, which depends on the target's model type and layer count: give --model TARGET")
    bounds = result.boundaries

    H = int(config["hidden_size"])
    Ht = int(config.get("target_hidden_size") or H)
    if target is not None and Ht != int(target.get_text_config(decoder=True).hidden_size):
        raise _fail(src, f"target_hidden_size {Ht}, the target's hidden_size is "
                         f"{target.get_text_config(decoder=True).hidden_size}")
    K = int(config.get("num_aux_hidden_states") or len(bounds))
    if K != len(bounds):
        raise _fail(src, f"num_aux_hidden_states {K} for {len(bounds)} aux layer ids")
    V = _vocab(src, config, target)
    D = int(config.get("draft_vocab_size") or V)
    if D > V:
        raise _fail(src, f"draft_vocab_size {D} exceeds the target's vocabulary {V}")
    norm_before_fc = bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
    required = {"fc.weight", "norm.weight", "lm_head.weight", *EAGLE3_LAYER}
    if norm_before_fc:
        required.add("input_norm.weight")
    if D < V:
        required.add("d2t")
    _check_keys(src, weights, required, {"d2t", "t2d", "embed_tokens.weight", "fc.bias"},
                {"input_norm.weight": "norm_before_fc is off"})
    for name, shape in (("fc.weight", (H, Ht * K)), ("lm_head.weight", (D, H)), ("norm.weight", (H,)),
                        ("d2t", (D,)), ("input_norm.weight", (Ht * K,))):
        _check_shape(src, weights, name, shape)
    _drop_zero_bias(src, weights, result.dropped)
    for name in ("t2d", "embed_tokens.weight"):
        if weights.pop(name, None) is not None:
            result.dropped.append(name)

    d2t = weights.pop("d2t", None)
    if d2t is not None:
        if d2t.is_floating_point():
            raise _fail(src, f"d2t is {d2t.dtype}, not integer offsets")
        hot = torch.arange(D) + d2t.to(torch.long)
        if int(hot.min()) < 0 or int(hot.max()) >= V:
            raise _fail(src, f"d2t maps draft ids to target ids outside 0..{V - 1}")
        if hot.unique().numel() != D:
            raise _fail(src, "d2t maps two draft ids to the same target id"
                             + (": a same-size d2t must be a permutation of the vocabulary to be folded into lm_head"
                                if D == V else ""))
        if D == V:  # vLLM has no place for a same-size d2t: fold it
            lm_head = weights["lm_head.weight"]
            folded = torch.empty_like(lm_head)
            folded[hot] = lm_head
            weights["lm_head.weight"] = folded
            result.folded = True
            result.dropped.append("d2t (folded into lm_head)")
        else:
            weights["d2t"] = d2t.to(torch.int64)
            result.kept_d2t = True

    out = dict(config)
    out.pop("eagle_aux_hidden_state_layer_ids", None)  # vLLM would read the top level first: one place only
    eagle["eagle_aux_hidden_state_layer_ids"] = result.ids
    out["eagle_config"] = eagle
    out["draft_vocab_size"] = D
    out["vocab_size"] = V
    out["architectures"] = [EAGLE3_ARCH]
    out[MARKER] = {RULE_KEY: "vllm", BOUNDARIES_KEY: result.boundaries,
                   "converted_from": {"path": str(src), RULE_KEY: result.source_rule,
                                      "aux_layer_ids": result.source_ids}}
    return out, weights


def _convert_eagle(src: Path, config: dict, weights: dict, target, result: VllmHead) -> tuple[dict, dict]:
    _refused_options(src, config, EAGLE_REFUSED)
    H, n = int(config["hidden_size"]), int(config.get("num_hidden_layers", 1))
    if target is not None and H != int(target.get_text_config(decoder=True).hidden_size):
        raise _fail(src, f"hidden_size {H}, the target's is {target.get_text_config(decoder=True).hidden_size}: the "
                         "EAGLE fc reads the target's embedding and final state")
    _vocab(src, config, target)
    required = {"fc.weight"} | {f"layers.{i}.{k}" for i in range(n) for k in EAGLE_LAYER} \
        | {f"layers.{i}.input_layernorm.weight" for i in range(1, n)}
    _check_keys(src, weights, required, {"fc.bias", "lm_head.weight", "embed_tokens.weight"},
                {"layers.0.input_layernorm.weight": "the first EAGLE layer has no input norm in SGLang or vLLM"})
    _check_shape(src, weights, "fc.weight", (H, 2 * H))
    _drop_zero_bias(src, weights, result.dropped)
    for name in ("lm_head.weight", "embed_tokens.weight"):  # SGLang's EAGLE uses the target's; vLLM then does too
        if weights.pop(name, None) is not None:
            result.dropped.append(f"{name} (the target's is used)")
    out = dict(config)
    out["architectures"] = ["LlamaForCausalLM"]  # vLLM: EagleLlamaForCausalLM
    out[MARKER] = {RULE_KEY: "vllm", "converted_from": {"path": str(src), "architecture": EAGLE_ARCH}}
    return out, weights


def _check_dst(dst: Path, overwrite: bool) -> None:
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise HsxError(f"{dst} is not a directory")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise HsxError(f"{dst} exists and is not empty; give --force to replace it")


def _write(dst: Path, config: dict, weights: dict, overwrite: bool) -> None:
    from safetensors.torch import save_file

    _check_dst(dst, overwrite)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / ".model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
    os.replace(tmp, dst / "model.safetensors")
    tmp = dst / ".config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, dst / "config.json")


def convert_vllm_head(src: str | Path, dst: str | Path, *, model: str | None = None, overwrite: bool = False,
                      trust_remote_code: bool = False) -> VllmHead:
    """Write ``src`` (an EAGLE3 or EAGLE head in SGLang's format) to ``dst`` in vLLM 0.32's format, marked ``"vllm"``.

    ``model``: the target (its directory or hub name): needed for a head without the hsx marker (SGLang's
    id rule depends on the target), and when given it checks widths and the vocabulary."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise HsxError(f"{dst} is the source head; write the vLLM head elsewhere")
    _check_dst(dst, overwrite)
    config, weights = read_head(src)
    marker = head_marker(config)
    if marker is not None and marker[RULE_KEY] == "vllm":
        raise _fail(src, "its hsx marker says it is in vLLM's format already (aux_layer_ids_rule 'vllm')")
    kind = head_kind(src)
    if kind is None:
        raise _fail(src, f"config.json names architectures {config.get('architectures')}; expected {EAGLE3_ARCH} "
                         f"(EAGLE3) or {EAGLE_ARCH} (EAGLE), SGLang's head formats")
    target = _target(model, trust_remote_code)
    result = VllmHead(kind, src, dst)
    convert = _convert_eagle3 if kind == "eagle3" else _convert_eagle
    out_config, out_weights = convert(src, config, weights, target, result)
    _write(dst, out_config, out_weights, overwrite)
    return result


def write_ids_copy(src: str | Path, dst: str | Path, ids: list[int], rule: str, boundaries) -> Path:
    """A copy of the head ``src`` whose config names ``ids`` (for ``boundaries`` under ``rule``), marked so; every
    other file linked (symbolic links), nothing else changed. For an engine that reads the ids from the file
    by another rule than the head's (``--engine sglang`` with a head marked ``"vllm"``)."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    before = head_marker(config) or {}
    dst.mkdir(parents=True, exist_ok=False)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    config.pop("eagle_aux_hidden_state_layer_ids", None)
    config["eagle_config"] = {**(config.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": list(ids)}
    config[MARKER] = {RULE_KEY: rule, BOUNDARIES_KEY: [int(b) for b in boundaries],
                      "converted_from": {"path": str(src), **before}}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst
