"""The test of truth: an independent, unbatched, teacher-forced forward of the same model."""

from __future__ import annotations

import torch


# Where each family keeps its final norm, written out by hand: the engine finds it from the module
# tree instead, so the two can disagree and a test will say so.
FINAL_NORM = {
    "gpt2": "transformer.ln_f",
    "gpt_neox": "gpt_neox.final_layer_norm",
    "lfm2": "model.embedding_norm",  # applied after the blocks, despite its name
    "falcon_h1": "model.final_layernorm",
}


def final_norm(model) -> torch.nn.Module:
    return model.get_submodule(FINAL_NORM.get(model.config.model_type, "model.norm"))


def logits_of(model, final: torch.Tensor) -> torch.Tensor:
    """lm_head of the final state, with the output soft-capping the family applies (Gemma 2)."""
    logits = model.get_output_embeddings()(final) * getattr(model.config, "lm_head_multiplier", 1.0)  # Falcon-H1
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def oracle_sources(model, ids: torch.Tensor) -> dict:
    """States for every position of ``ids``: boundaries 0..L and "final" (docs/FORMAT.md, layer boundaries).

    transformers' hidden_states[b] is boundary b for b < L, its last entry is the final-norm
    output; boundary L (the last block's output before the norm) is taken with a hook.
    """
    num_layers = model.config.num_hidden_layers
    if getattr(model.config, "hc_mult", 1) > 1:
        return _stream_sources(model, ids)
    box = {}

    def keep_input(module, args):  # returns None: a pre-hook's return value would replace the input
        box["pre"] = args[0][0]

    norm = final_norm(model)
    handle = norm.register_forward_pre_hook(keep_input)
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None].long(), output_hidden_states=True)
    finally:
        handle.remove()
    hs = [h[0] for h in out.hidden_states]
    # the mapping is checked, not assumed: the last entry feeds lm_head and is the norm of boundary L
    assert len(hs) == num_layers + 1
    with torch.no_grad():
        assert (logits_of(model, hs[num_layers]) - out.logits[0]).abs().max() < 1e-5
        assert (norm(box["pre"]) - hs[num_layers]).abs().max() < 1e-5
    states = {b: hs[b] for b in range(num_layers)}
    states[num_layers] = box["pre"]
    states["final"] = hs[num_layers]
    return states


def oracle_rows(model, ids: torch.Tensor, groups) -> dict[str, torch.Tensor]:
    """Rows of each layer group (objects with ``name`` and ``sources``) for every position of ``ids``."""
    src = oracle_sources(model, ids)
    return {g.name: torch.cat([src[s] for s in g.sources], -1) for g in groups}


def _stream_sources(model, ids: torch.Tensor) -> dict:
    """Hyper-connection models (DeepSeek-V4): boundary 0 is what the first decoder layer receives, boundary b
    what decoder layer b-1 returns, each ``[T, hc_mult, hidden]`` flattened stream by stream; "final" is
    transformers' last hidden-state entry (the collapse of the streams, normed), checked to feed lm_head."""
    layers = model.model.layers
    streams = {}
    hooks = [layers[0].register_forward_pre_hook(lambda module, args: streams.__setitem__(0, args[0][0]))]
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(lambda module, args, out, b=i + 1: streams.__setitem__(b, out[0])))
    try:
        with torch.no_grad():
            out = model(input_ids=ids[None].long(), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    final = out.hidden_states[-1][0]
    with torch.no_grad():
        assert (logits_of(model, final) - out.logits[0]).abs().max() < 1e-5
    states = {b: s.reshape(s.shape[0], -1) for b, s in streams.items()}  # [T, hc_mult * hidden], stream 0 first
    states["final"] = final
    return states
