"""Tiny random causal LMs built locally (no download), and drafts derived from them.

All builders are deterministic for a given seed, return float32 models in eval mode, and leave
the global torch RNG untouched.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def _tiny_config(config_cls, num_layers: int, hidden_size: int, vocab_size: int, kw: dict):
    defaults = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    defaults.update(kw)
    return config_cls(**defaults)


def _build(model_cls, config, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float().eval()


def build_tiny_llama(num_layers: int = 8, hidden_size: int = 128, vocab_size: int = 512, seed: int = 0, **kw) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM``; extra keywords go to ``LlamaConfig``."""
    return _build(LlamaForCausalLM, _tiny_config(LlamaConfig, num_layers, hidden_size, vocab_size, kw), seed)


def build_tiny_qwen2(num_layers: int = 8, hidden_size: int = 128, vocab_size: int = 512, seed: int = 0, **kw) -> Qwen2ForCausalLM:
    """A random ``Qwen2ForCausalLM`` (q/k/v biases, unlike Llama); extra keywords go to ``Qwen2Config``."""
    return _build(Qwen2ForCausalLM, _tiny_config(Qwen2Config, num_layers, hidden_size, vocab_size, kw), seed)


def make_layerskip_draft(target, num_layers: int = 2):
    """A draft made of the target's embeddings, first ``num_layers`` blocks, final norm and lm_head.

    It shares the target's early computation, so on a trained model it often agrees with the
    target without any training. On a random tiny model every block moves the near-uniform logits,
    so acceptance stays low; :func:`perturbed_copy` with a small scale gives real acceptance there.
    """
    total = target.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"a layer-skip draft needs 1..{total} blocks, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:num_layers])
    draft = type(target)(config)
    dropped = tuple(f"model.layers.{i}." for i in range(num_layers, total))
    state = {k: v for k, v in target.state_dict().items() if not k.startswith(dropped)}
    draft.load_state_dict(state, strict=True)
    return draft.to(dtype=target.dtype).eval()


def perturbed_copy(target, scale: float, seed: int = 0):
    """A copy of ``target`` with every parameter moved by ``scale`` x its RMS x N(0, 1) noise."""
    model = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype)
            p.add_(noise * p.detach().float().pow(2).mean().sqrt().to(p.dtype) * scale)
    return model.eval()
