"""What the transformers engine needs to know about a model family, read from the model itself.

Two things differ between the families transformers ships and both decide whether rows are right:

* **Attention visibility per layer.** Full-attention layers see every earlier token of their row;
  sliding-window layers (Mistral, Phi-3, Gemma 2/3, GPT-OSS, ...) see only keys whose position
  is within ``window - 1`` of the query's. The engine passes its own 4-D masks, which transformers
  uses as given, so the window must be in those masks: :class:`AttentionPlan` says which window
  each layer type has and whether the model takes one mask or one per layer type.
* **Recurrent layers.** Gated DeltaNet and KDA linear attention (Qwen3.5, Qwen3-Next,
  Kimi-Linear), LFM2's short convolutions and Falcon-H1's Mamba-2 (beside attention in one
  ``hybrid`` layer) carry a state per row instead of a key and value per token. They take no
  mask: the engine never lets padding or a rejected draft into their state
  (:mod:`hsx.engine.hf.state`), and refuses what that rules out (draft trees). DeepSeek-V4's
  compressed attention keeps such a state beside its sliding-window keys: the compressor's open
  window and its entries (:mod:`hsx.engine.hf.compressed`).
* **Where the final norm is.** ``model.norm`` (Llama, Qwen, Gemma, GPT-OSS),
  ``transformer.ln_f`` (GPT-2), ``gpt_neox.final_layer_norm`` (GPT-NeoX), ... :func:`find_layout`
  finds the decoder blocks and the final norm from the module tree, and :func:`check_layout`
  proves the finding on one short forward before the engine trusts it.

Anything these rules do not cover is refused before the first real forward, naming the model
type and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsx.errors import HsxError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
LINEAR, CONV, HYBRID = "linear_attention", "conv", "hybrid"
DUMMY = "dummy"  # transformers' cache kind of a layer that reuses another's keys and values, or has no attention
# layer kinds refused, and why (the message names them; any other unknown kind is refused too)
NOT_YET = {"hybrid_sliding": "a recurrent mixer beside sliding attention in one layer is not wired yet"}
# compressed attention (DeepSeek-V4): sliding-window keys plus compressed entries of closed windows of tokens, which
# transformers' compressor keeps with the open window in its own cache layer (hsx.engine.hf.compressed): a state
# per row, like a recurrent layer's
COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")
# layer kinds with a recurrent state, and the mask keys each one's model reads: a hybrid layer (Mamba-2 and
# attention side by side, Falcon-H1) reads the full-attention mask and the linear-attention one
RECURRENT = {LINEAR: (LINEAR,), CONV: (CONV,), HYBRID: (FULL, LINEAR)}
# attention implementations that add the engine's float 4-D mask to the scores as given
MASKED_IMPLEMENTATIONS = ("eager", "sdpa")


def model_type(model) -> str:
    return str(getattr(model.config, "model_type", type(model).__name__))


def _text_config(model):
    return model.config.get_text_config(decoder=True)


# ---- attention -------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionPlan:
    """Visibility rules of one model: a window per layer type (``None`` = full attention).

    ``per_type`` models (their config lists ``layer_types``) take a dict ``{layer type: mask}``;
    the others take a single mask used by every layer, so all their layers share one window.
    """

    # layer type -> window (sliding: keys a query may see, q_pos - k_pos < window; chunked: the chunk
    # size, keys in the query's chunk of positions, q_pos // size == k_pos // size) or None (full)
    windows: dict
    per_type: bool
    recurrent: tuple = ()  # mask keys of recurrent layers: they get None (no mask, no padding)
    state_kinds: tuple = ()  # the layer kinds that keep a state per row, e.g. ("linear_attention",)

    @property
    def stateful(self) -> bool:
        """Some layers keep a recurrent state: rows must never carry padding or rejected tokens into it."""
        return bool(self.state_kinds)

    @staticmethod
    def from_model(model, what: str) -> "AttentionPlan":
        from transformers.cache_utils import get_layer_types_and_kwargs

        name = model_type(model)
        config = _text_config(model)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in (None, *MASKED_IMPLEMENTATIONS):
            raise HsxError(f"{what} ({name}): attention implementation {impl!r} ignores the engine's 4-D float "
                           f"masks; load it with 'sdpa' or 'eager'")
        if getattr(config, "use_bidirectional_attention", False):
            raise HsxError(f"{what} ({name}): use_bidirectional_attention=True is not causal decoding; "
                           f"the transformers engine supports causal attention only")
        # transformers' own reading of the config: it builds its caches from the same list
        types, kwargs = get_layer_types_and_kwargs(config)
        windows: dict = {}
        recurrent: dict = {}
        state_kinds: dict = {}
        for i, (kind, kw) in enumerate(zip(types, kwargs)):
            if kind == DUMMY:  # no cache of its own: reads another layer's keys (Gemma 4) or has no attention
                continue
            if kind in COMPRESSED:  # its own keys in a sliding window, its compressed entries masked by its compressor
                windows[kind], state_kinds[kind] = int(config.sliding_window), None
                continue
            if kind in RECURRENT:
                state_kinds[kind] = None
                for key in RECURRENT[kind]:
                    if key == FULL:
                        windows[FULL] = None
                    else:
                        recurrent[key] = None
                continue
            if kind not in (FULL, SLIDING, CHUNKED):
                why = f": {NOT_YET[kind]}" if kind in NOT_YET else ""
                raise HsxError(f"{what} ({name}): layer {i} is of type {kind!r}{why}; the transformers engine implements "
                               f"{FULL!r}, {SLIDING!r}, {CHUNKED!r} and recurrent ({', '.join(map(repr, RECURRENT))}) "
                               f"layers only")
            if kind == CHUNKED and getattr(config, "layer_types", None) is None:
                raise HsxError(f"{what} ({name}): layer {i} is of type {kind!r} (from attention_chunk_size) but the "
                               f"config lists no layer_types, so the model builds no chunked mask of its own to "
                               f"match; refused rather than guessed")
            window = None if kind == FULL else int(kw["sliding_window"])
            if window is not None and window < 1:
                raise HsxError(f"{what} ({name}): layer {i} has sliding_window {window}, expected >= 1")
            if windows.setdefault(kind, window) != window:
                raise HsxError(f"{what} ({name}): {kind!r} layers have different windows "
                               f"({windows[kind]} and {window}); one window per layer type is supported")
        per_type = getattr(config, "layer_types", None) is not None
        if not per_type and len(windows) > 1:
            raise HsxError(f"{what} ({name}): full and sliding layers without a layer_types list: the model takes "
                           f"one mask for all layers, which cannot express both")
        return AttentionPlan(windows, per_type, tuple(recurrent), tuple(state_kinds))

    def masks(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype):
        """The ``attention_mask`` argument for ``visible [B, q, K]``, queries at ``q_pos [B, q]`` and keys
        at ``k_pos [B, K]``: one float mask ``[B, 1, q, K]``, or a dict of them keyed by layer type."""
        out = {}
        for kind, window in self.windows.items():
            see = visible
            if kind == CHUNKED:
                see = see & ((q_pos[:, :, None] // window) == (k_pos[:, None, :] // window))  # [B, q, K]
            elif window is not None:
                see = see & ((q_pos[:, :, None] - k_pos[:, None, :]) < window)  # [B, q, K]
            out[kind] = _float_mask(see, dtype)
        out.update(dict.fromkeys(self.recurrent))
        return out if self.per_type else next(iter(out.values()))


def window_plan(model) -> AttentionPlan | None:
    """The attention plan of a vision-language target with sliding-window layers, else None. transformers'
    sliding cache layers keep the last slots by count and its decode masks count the window in slots: both
    wrong for a right-padded row shorter than the batch, so such a target decodes (and verifies drafts) with
    masks of its own, by position."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    if all(kind == FULL or kind in RECURRENT for kind in types):  # no window (Qwen3.5: linear and full attention)
        return None
    return AttentionPlan.from_model(model, "vision-language target")


def recurrent_kinds(config) -> tuple[str, ...]:
    """The layer kinds of a model's ``config`` that keep a recurrent state instead of keys and values, e.g.
    ``("linear_attention",)`` (transformers' reading of the config)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    return tuple(dict.fromkeys(k for k in get_layer_types_and_kwargs(text)[0] if k in RECURRENT))


def has_recurrent_layers(model) -> bool:
    """Some layers keep a recurrent state instead of keys and values (transformers' reading of the config)."""
    return bool(recurrent_kinds(model.config))


def slot_limit(model) -> int | None:
    """Cache slots per row within which the engine's rows are exact, where a model reads a cache slot as a
    position (None: no such limit). Llama 4 scales the queries of its NoPE layers by
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` with p counted in cache slots, not from
    ``position_ids``: the scale is 1 at every p below ``floor_scale - 1``, in the engine's compacted
    cache and in a plain forward alike."""
    config = _text_config(model)
    if getattr(config, "attn_temperature_tuning", False) and not all(getattr(config, "no_rope_layers", None) or [1]):
        return int(config.floor_scale) - 1
    return None


def _float_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # float mask with the dtype's minimum: eager attention adds a bool mask to the scores as 0/1.
    # Filled in place: one float tensor of the mask's size, no second one and no inverted bool copy
    mask = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return mask.masked_fill_(visible, 0.0)[:, None]  # [B, 1, q, K]


# ---- module layout ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """The decoder blocks and the final norm of a causal LM, by module path."""

    blocks: str  # e.g. "model.layers", "transformer.h"
    final_norm: str  # e.g. "model.norm", "transformer.ln_f"
    # hyper-connection models: the module collapsing the last block's hc_mult streams into the final
    # norm's input (DeepSeek-V4's "model.hc_head"); boundary L is then the last block's output
    collapse: str | None = None

    def norm(self, model) -> torch.nn.Module:
        return model.get_submodule(self.final_norm)


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def find_layout(model, what: str = "model") -> Layout:
    """Blocks: the one ``ModuleList`` of ``num_hidden_layers`` modules. Final norm: of the norm modules
    registered outside the blocks, after them, the one whose output a 4-token forward hands lm_head (the
    last of them when none does: :func:`check_layout` then says so)."""
    name = model_type(model)
    num_layers = int(_text_config(model).num_hidden_layers)
    named = list(model.named_modules())
    lists = [n for n, m in named if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if len(lists) != 1:
        raise HsxError(f"{what} ({name}): expected one list of {num_layers} decoder blocks, found {lists or 'none'}")
    blocks = lists[0]
    after = False
    norms = []
    for n, m in named:
        if n == blocks:
            after = True
        elif after and not n.startswith(blocks + ".") and _is_norm(m):
            norms.append(n)
    if not norms:
        raise HsxError(f"{what} ({name}): no normalisation module after the decoder blocks {blocks!r}; boundary L "
                       f"(the final norm's input) and 'final' cannot be captured")
    norm = norms[-1] if len(norms) == 1 else _feeding_lm_head(model, norms)
    return Layout(blocks, norm, _collapse(model, blocks, norm) if hc_mult(model) > 1 else None)


def hc_mult(model) -> int:
    """Parallel residual streams between blocks (hyper-connections, DeepSeek-V4); 1 elsewhere."""
    return int(getattr(_text_config(model), "hc_mult", None) or 1)


def _collapse(model, blocks: str, norm: str) -> str | None:
    """The module beside the blocks that receives the last block's output and returns the final norm's input,
    found on a 4-token forward (None when there is none: :func:`check_layout` then says so)."""
    prefix = blocks.rpartition(".")[0]
    names = [f"{prefix}.{n}" for n, _ in model.get_submodule(prefix).named_children()]
    names = [n for n in names if n not in (blocks, norm)]
    rec = _Recorder()
    last = model.get_submodule(blocks)[-1]
    hooks = [last.register_forward_hook(rec.grab("last"))]
    hooks.append(model.get_submodule(norm).register_forward_pre_hook(rec.grab("norm_in", output=False)))
    for n in names:
        hooks += [model.get_submodule(n).register_forward_pre_hook(rec.grab(f"in:{n}", output=False)),
                  model.get_submodule(n).register_forward_hook(rec.grab(f"out:{n}"))]
    try:
        with torch.inference_mode():
            model(input_ids=_probe_ids(model, next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    last_out, norm_in = rec.seen["last"][:1], rec.seen["norm_in"][:1]
    found = [n for n in names if rec.seen[f"in:{n}"] and last_out and norm_in
             and _same(rec.seen[f"in:{n}"][0], last_out[0]) and _same(rec.seen[f"out:{n}"][0], norm_in[0])]
    return found[0] if len(found) == 1 else None


def _feeding_lm_head(model, norms: list[str]) -> str:
    """Of the norm modules ``norms``, the one whose output is lm_head's input on a 4-token forward (Gemma 4
    registers the norm of its per-layer inputs after the final norm)."""
    head = model.get_output_embeddings()
    if head is None:
        return norms[-1]
    rec = _Recorder()
    hooks = [model.get_submodule(n).register_forward_hook(rec.grab(n)) for n in norms]
    hooks.append(head.register_forward_pre_hook(rec.grab("head_in", output=False)))
    try:
        with torch.inference_mode():
            model(input_ids=_probe_ids(model, head.weight.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    head_in = rec.seen["head_in"][-1:]
    feeding = [n for n in norms if head_in and any(_same(out, head_in[0]) for out in rec.seen[n])]
    return feeding[-1] if feeding else norms[-1]


def _same(a, b) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def _probe_ids(model, device) -> torch.Tensor:
    return torch.arange(4, device=device)[None] % int(_text_config(model).vocab_size)


def check_layout(model, layout: Layout, what: str = "model") -> None:
    """One 4-token forward proving the layout: ``hidden_states[0]`` is the first block's input,
    ``hidden_states[b]`` is block b-1's output (b < L), the final norm runs once on the last block's
    output, and its output is exactly lm_head's input."""
    name = model_type(model)
    blocks = model.get_submodule(layout.blocks)
    head = model.get_output_embeddings()
    if head is None:
        raise HsxError(f"{what} ({name}): no output embeddings (lm_head); not a causal LM the engine can drive")
    rec = _Recorder()
    hooks = [blocks[0].register_forward_pre_hook(rec.grab("first_in", output=False))]
    hooks += [b.register_forward_hook(rec.grab(f"block{i}")) for i, b in enumerate(blocks)]
    hooks += [layout.norm(model).register_forward_hook(rec.grab("norm_in", output=False)),
              layout.norm(model).register_forward_hook(rec.grab("norm_out")),
              head.register_forward_pre_hook(rec.grab("head_in", output=False))]
    if layout.collapse is not None:
        hooks += [model.get_submodule(layout.collapse).register_forward_hook(rec.grab("collapse_in", output=False)),
                  model.get_submodule(layout.collapse).register_forward_hook(rec.grab("collapse_out"))]
    elif hc_mult(model) > 1:
        raise HsxError(f"{what} ({name}): {hc_mult(model)} hyper-connection streams, and no module found that "
                       f"collapses the last block's streams into {layout.final_norm}'s input")
    try:
        with torch.inference_mode():
            hs = model(input_ids=_probe_ids(model, head.weight.device), output_hidden_states=True,
                       use_cache=False).hidden_states
    finally:
        for h in hooks:
            h.remove()
    num_layers = len(blocks)
    labels = {"first_in": "the first block", "norm_in": layout.final_norm, "norm_out": layout.final_norm,
              "head_in": "lm_head", "collapse_in": layout.collapse, "collapse_out": layout.collapse}
    ran = {labels.get(k, f"block {k.removeprefix('block')}"): len(v) for k, v in rec.seen.items()}
    problems = [f"{k} ran {n} times, expected once" for k, n in ran.items() if n != 1]
    if hs is None or len(hs) != num_layers + 1:
        problems.append(f"{None if hs is None else len(hs)} hidden-state entries, expected {num_layers + 1}")
    if not problems:
        pairs = [("hidden_states[0]", hs[0], "the first block's input", rec.one("first_in"))]
        pairs += [(f"hidden_states[{b}]", hs[b], f"block {b - 1}'s output", rec.one(f"block{b - 1}"))
                  for b in range(1, num_layers)]
        last = ("the last block's output", rec.one(f"block{num_layers - 1}"))
        if layout.collapse is not None:  # streams -> collapse -> norm
            pairs += [(f"{layout.collapse}'s input", rec.one("collapse_in"), *last),
                      (f"{layout.final_norm}'s input", rec.one("norm_in"), f"{layout.collapse}'s output",
                       rec.one("collapse_out"))]
        else:
            pairs += [(f"{layout.final_norm}'s input", rec.one("norm_in"), *last)]
        pairs += [("lm_head's input", rec.one("head_in"), f"{layout.final_norm}'s output", rec.one("norm_out"))]
        problems = [f"{a} is not {b}" for a, x, b, y in pairs
                    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor)
                    or x.shape != y.shape or not torch.equal(x, y)]
    if problems:
        raise HsxError(f"{what} ({name}): the engine's layer boundaries do not hold for this model: "
                       + "; ".join(problems))


class _Recorder:
    """Forward (pre-)hooks that keep the first tensor of what a module received or returned."""

    def __init__(self):
        self.seen: dict[str, list] = {}

    def grab(self, key: str, output: bool = True):
        self.seen[key] = []

        def hook(module, args, out=None):
            value = out if output else (args[0] if args else None)  # None: the input came as a keyword
            self.seen[key].append(value[0] if isinstance(value, tuple) else value)

        return hook

    def one(self, key: str) -> torch.Tensor:
        return self.seen[key][0]


# ---- loading ---------------------------------------------------------------------------------

def refuse_incomplete_load(path: str, info: dict, what: str) -> None:
    """Refuse a checkpoint whose load left parameters missing (randomly initialised) or brought weights
    the architecture has no place for, from transformers' own loading report (``output_loading_info``)."""
    problems = []
    for key, label in (("missing_keys", "missing (would be randomly initialised)"),
                       ("unexpected_keys", "unexpected (the architecture has no place for them)")):
        keys = sorted(info.get(key) or ())
        if keys:
            shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            problems.append(f"{len(keys)} weights {label}: {shown}")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        problems.append("weights of the wrong shape: " + ", ".join(f"{k} (checkpoint {tuple(a)}, model {tuple(b)})"
                                                                   for k, a, b in mismatched[:8]))
    if info.get("error_msgs"):
        problems.append("load errors: " + "; ".join(str(m) for m in info["error_msgs"][:4]))
    if problems:
        raise HsxError(f"{what} {path!r} does not match its architecture: " + "; ".join(problems))


def load_causal_lm(path: str, dtype: torch.dtype, trust_remote_code: bool = False, what: str = "model"):
    """``AutoModelForCausalLM.from_pretrained`` with an attention implementation that takes the engine's
    masks: sdpa where the family supports it, else eager (Gemma 2 and GPT-OSS: soft-capping and sinks).

    The load must be complete: a missing, unexpected or mis-shaped weight is refused with the keys named.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:  # remote code: let transformers choose, the engine refuses what it cannot mask
        cls = None
    impl = None if cls is None else ("sdpa" if getattr(cls, "_supports_sdpa", False) else "eager")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                       attn_implementation=impl, output_loading_info=True,
                                                       **NO_HUB_KERNELS)
    refuse_incomplete_load(path, info, what)
    return model


# transformers 5.25 swaps layers for Hub kernels by default (code fetched from the Hub, numerics of
# their own, and no support for the meta device the check below loads on): hsx runs the model's own code
NO_HUB_KERNELS = {"use_kernels": False}


def check_checkpoint(path: str, what: str = "model", trust_remote_code: bool = False) -> None:
    """The same completeness check as :func:`load_causal_lm` for an engine that loads the weights itself:
    transformers builds the model on the meta device (reading no weight) and reports which checkpoint
    keys it could not place."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    # the meta device needs accelerate; without it the check loads the weights on the CPU once
    where = {"device_map": "meta"} if importlib.util.find_spec("accelerate") else {"dtype": "auto"}
    model, info = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                       output_loading_info=True, **where, **NO_HUB_KERNELS)
    del model
    refuse_incomplete_load(path, info, what)
