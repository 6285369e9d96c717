"""A tiny target with EAGLE and EAGLE3 drafts in SGLang's on-disk formats, acceptance set by the prompt.

The target is built to follow a permutation ``sigma`` of its vocabulary: its embeddings are random
(std 1), its lm_head row ``j`` is the embedding of ``sigma^-1(j)``, and its blocks are scaled down
(``block_scale``) so that the embedding of the current token dominates the final state; greedy
decoding then mostly walks ``x -> sigma(x) -> sigma^2(x) ...`` while the blocks still read the whole
context. ``sigma`` maps three token classes onto themselves, so the class of a prompt's last token
decides the regime of the whole completion:

- ``follow``: the drafts predict ``sigma`` exactly (nearly every draft accepted);
- ``mixed``: they predict ``sigma`` for half of the class and a wrong token for the other half;
- ``miss``: they always predict a wrong token, one step ahead of the right one (no draft accepted).

Both drafts carry the regime in one MLP used as a lookup table (one hidden unit per token: the unit
of token ``x`` fires when the block's input is the embedding of ``x`` and adds ``E[g(x)] - E[x]``);
their attention has a zero output projection, so it runs but never changes a draft.

- EAGLE (``LlamaForCausalLMEagle``): ``fc`` passes the token embedding through, the MLP maps a
  follow token to itself (``g = id``) and a wrong one elsewhere; SGLang shares the target's
  embedding and lm_head, so the draft predicts ``sigma(g(x))``.
- EAGLE3 (``LlamaForCausalLMEagle3``, aux ids ``[1, 3, 5]`` = boundaries 2, 4, 6): ``fc`` passes
  the boundary-2 state of the target (close to the embedding of the token at that position) through,
  the MLP maps it by ``g = sigma`` (or wrongly), and its own lm_head (draft vocabulary in a permuted
  order, mapped back by ``d2t``) reads ``sigma`` again: from the state at position t it predicts
  ``sigma^2(x_t)``, and each further step feeds its own output back and moves one more step.

Four tokens ``p -> q -> z -> eos -> p`` form their own cycle in the follow class: a prompt ending
in ``p`` makes the drafts propose ``eos`` inside an accepted run (:attr:`SpecModels.stop_prompt_tail`).
Special tokens are fixed points and never used in prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer

REGIMES = ("follow", "mixed", "miss")
EAGLE3_IDS = [1, 3, 5]  # SGLang captures boundaries id + 1 = 2, 4, 6 for a Llama target
DETECT_GAIN = 40.0  # sharpness of a lookup unit: silu(gain * cos) * cos is ~gain for the matching token only


@dataclass
class SpecModels:
    """Paths and token classes of a built set (see the module docstring)."""

    root: Path
    target: Path
    eagle: Path
    eagle3: Path
    classes: dict[str, list[int]] = field(default_factory=dict)  # regime -> prompt-usable token ids
    stop_prompt_tail: int = -1  # a prompt ending in this token runs p -> q -> z -> eos
    num_layers: int = 8

    def save_index(self) -> None:
        index = {"classes": self.classes, "stop_prompt_tail": self.stop_prompt_tail, "num_layers": self.num_layers,
                 "eagle3_aux_ids": EAGLE3_IDS}
        (self.root / "spec_models.json").write_text(json.dumps(index))


def _unit(v: torch.Tensor) -> torch.Tensor:
    """Rows scaled to RMS 1: what an RMSNorm with unit weight outputs."""
    return v / v.pow(2).mean(-1, keepdim=True).sqrt()


def _lookup_mlp(E: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> dict[str, torch.Tensor]:
    """gate/up/down weights of an MLP that adds ``E[dst_k] - E[src_k]`` when its input is RMS-normed ``E[src_k]``."""
    H = E.shape[1]
    keys = _unit(E[src]) / H  # [n, H]: keys . unit(E[x]) = cos(E[src_k], E[x])
    delta = E[dst] - E[src]  # [n, H]
    # unit k outputs silu(gain * cos) * cos ~= gain at its own token and ~gain * cos^2 elsewhere
    return {"gate_proj.weight": keys * DETECT_GAIN, "up_proj.weight": keys.clone(),
            "down_proj.weight": (delta / DETECT_GAIN).T.contiguous()}


def _block(prefix: str, H: int, in_dim: int, heads: int, kv_heads: int, mlp: dict, gen, input_norm: bool,
           hidden_norm: bool) -> dict[str, torch.Tensor]:
    """One draft decoder layer: random q/k/v, zero o_proj (attention runs, adds nothing), the lookup MLP."""
    hd = H // heads
    w = {f"{prefix}.self_attn.q_proj.weight": torch.randn(heads * hd, in_dim, generator=gen) * 0.05,
         f"{prefix}.self_attn.k_proj.weight": torch.randn(kv_heads * hd, in_dim, generator=gen) * 0.05,
         f"{prefix}.self_attn.v_proj.weight": torch.randn(kv_heads * hd, in_dim, generator=gen) * 0.05,
         f"{prefix}.self_attn.o_proj.weight": torch.zeros(H, heads * hd),
         f"{prefix}.post_attention_layernorm.weight": torch.ones(H)}
    w.update({f"{prefix}.mlp.{k}": v for k, v in mlp.items()})
    if input_norm:
        w[f"{prefix}.input_layernorm.weight"] = torch.ones(H)
    if hidden_norm:
        w[f"{prefix}.hidden_norm.weight"] = torch.ones(H)
    return w


def _save_draft(out: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def _partition(vocab: int, specials: list[int], gen) -> tuple[dict[str, list[int]], list[int]]:
    """Regime classes of the ordinary tokens, and the four tokens p, q, z of the stop cycle (eos is the fourth)."""
    ordinary = [i for i in torch.randperm(vocab, generator=gen).tolist() if i not in specials]
    stop_cycle, rest = ordinary[:3], ordinary[3:]
    third = len(rest) // 3
    classes = {"follow": rest[:third], "mixed": rest[third:2 * third], "miss": rest[2 * third:]}
    return classes, stop_cycle


def build_spec_models(out: str | Path, seed: int = 0, block_scale: float = 10.0, hidden_size: int = 128,
                      num_layers: int = 8) -> SpecModels:
    """Write ``target/``, ``eagle/`` and ``eagle3/`` under ``out`` (deterministic for a seed; about a second)."""
    out = Path(out)
    tok = build_demo_tokenizer()
    V, H, L = len(tok), hidden_size, num_layers
    eos = tok.eos_token_id
    specials = sorted(set(tok.all_special_ids))
    gen = torch.Generator().manual_seed(seed)
    target = build_tiny_llama(num_layers=L, hidden_size=H, vocab_size=V, seed=seed + 1, eos_token_id=eos,
                              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    cfg = target.config
    classes, (p, q, z) = _partition(V, specials, gen)

    sigma = torch.arange(V)  # specials are fixed points (eos is re-mapped by the stop cycle below)
    for members in classes.values():  # one random cycle per class: sigma keeps each class
        order = torch.tensor(members)[torch.randperm(len(members), generator=gen)]
        sigma[order] = order.roll(-1)
    for a, b in ((p, q), (q, z), (z, eos), (eos, p)):
        sigma[a] = b
    inv = torch.empty_like(sigma)
    inv[sigma] = torch.arange(V)

    E = torch.randn(V, H, generator=gen)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(E)
        target.lm_head.weight.copy_(E[inv])  # logits_j = E[sigma^-1(j)] . h: argmax sigma(x) when h ~ E[x]
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(block_scale)
            layer.mlp.down_proj.weight.mul_(block_scale)
    target.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")

    # g: the drafts' step map, right except on the wrong tokens, where it skips one step ahead: the
    # proposal is then sigma^2(x) instead of sigma(x) (EAGLE), sigma^3(x) instead of sigma^2(x) (EAGLE3),
    # never right because the classes are cycles of more than a hundred tokens
    wrong_t = torch.tensor(list(classes["miss"]) + classes["mixed"][::2])

    base = {k: v for k, v in cfg.to_dict().items() if k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
        "rope_parameters", "hidden_act", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim")}
    base.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, torch_dtype="float32",
                intermediate_size=V)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads

    # EAGLE: fc = [I | 0] over cat(embedding, target state), g = id except on the wrong tokens
    g = torch.arange(V)
    g[wrong_t] = sigma[wrong_t]
    w = _block("layers.0", H, H, heads, kv, _lookup_mlp(E, torch.arange(V), g), gen, input_norm=False,
               hidden_norm=False)
    fc = torch.zeros(H, 2 * H)
    fc[:, :H] = torch.eye(H)
    w.update({"fc.weight": fc, "fc.bias": torch.zeros(H), "embed_tokens.weight": E.clone(),
              "lm_head.weight": E[inv].clone()})
    _save_draft(out / "eagle", dict(base, architectures=["LlamaForCausalLMEagle"]), w)

    # EAGLE3: fc picks boundary 2 (the first aux chunk), g = sigma except on the wrong tokens
    g3 = sigma.clone()
    g3[wrong_t] = sigma[sigma[wrong_t]]
    w = _block("midlayer", H, 2 * H, heads, kv, _lookup_mlp(E, torch.arange(V), g3), gen, input_norm=True,
               hidden_norm=True)
    fc = torch.zeros(H, 3 * H)
    fc[:, :H] = torch.eye(H)
    draft_order = torch.randperm(V, generator=gen)  # draft id d is target id draft_order[d]
    w.update({"fc.weight": fc, "norm.weight": torch.ones(H), "lm_head.weight": E[inv[draft_order]].clone(),
              "embed_tokens.weight": E.clone(), "d2t": draft_order - torch.arange(V),
              "t2d": torch.ones(V, dtype=torch.bool)})
    e3 = dict(base, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=V, target_hidden_size=H,
              eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE3_IDS, "use_aux_hidden_state": True})
    _save_draft(out / "eagle3", e3, w)

    models = SpecModels(out, out / "target", out / "eagle", out / "eagle3", classes=classes, stop_prompt_tail=p,
                        num_layers=L)
    models.save_index()
    return models


def load_spec_models(root: str | Path) -> SpecModels:
    root = Path(root)
    index = json.loads((root / "spec_models.json").read_text())
    return SpecModels(root, root / "target", root / "eagle", root / "eagle3", classes=index["classes"],
                      stop_prompt_tail=index["stop_prompt_tail"], num_layers=index["num_layers"])
