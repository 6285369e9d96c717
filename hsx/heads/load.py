"""EAGLE3 draft heads in SGLang's / SpecForge's on-disk format, run by the transformers engine.

A head directory holds ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``,
optional ``norm_before_fc``) and safetensors weights ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
``d2t`` (and optionally ``t2d``, ``embed_tokens``, ``input_norm``). The computation follows SGLang
0.5.23's ``srt/models/llama_eagle3.py`` (docs/EAGLE3.md, "Drafting with a head"):

    first step:  h = fc(norm_before_fc? RMSNorm(aux) : aux)      aux = K target boundaries, K*Ht wide
    later steps: h = the head's own previous output (pre-norm)
    x = cat(input_layernorm(embed(token)), hidden_norm(h))        2H wide; embed is the TARGET's
    r = attn(x) + h;  out = mlp(post_attention_layernorm(r)) + r
    logits = lm_head(norm(out)) over the draft vocabulary; draft id d is target id d + d2t[d]

Everything else in a head checkpoint, and anything it lacks, is refused with the keys named.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from hsx.heads.layer_ids import HF_READING, RULE_KEY, head_marker, resolve_head_layers
from hsx.errors import HsxError

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE_ARCH = "LlamaForCausalLMEagle"

_LAYER = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight",
          "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
          "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
          "midlayer.mlp.down_proj.weight")
# in a checkpoint but not used: SGLang replaces the head's embedding by the target's and ignores t2d
_IGNORED = ("embed_tokens.weight", "t2d")


def head_kind(path: str | Path) -> str | None:
    """``"eagle3"`` / ``"eagle"`` for a directory whose config names SGLang's head architectures, else None."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    if EAGLE3_ARCH in archs:
        return "eagle3"
    if EAGLE_ARCH in archs:
        return "eagle"
    return None


def _eagle_config(config: dict) -> dict:
    return config.get("eagle_config") or {}


def aux_layer_ids(config: dict) -> list[int] | None:
    ids = _eagle_config(config).get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Out:
    """A head forward's result: ``hidden`` at once, ``logits`` computed on first read, so a forward whose
    logits nobody reads (the prompt's, in prefill) never runs lm_head over its positions."""

    def __init__(self, head: "Eagle3Head", normed: torch.Tensor, hidden: torch.Tensor):
        self._head, self._normed, self.hidden = head, normed, hidden
        self._logits = None
        # the forward's autograd modes, for lm_head run later (an inference tensor cannot enter a graph)
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            grad, inference = self._modes
            # in this order: inference_mode(False) turns grad mode on
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self._logits = self._head.target_logits(self._normed)
            self._normed = None
        return self._logits


class Eagle3Head(nn.Module):
    """One EAGLE3 decoder layer with its fc, final norm and draft-vocabulary lm_head."""

    def __init__(self, config: dict, target_embed: nn.Embedding, target_vocab: int, path: str = "head"):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.path = path
        H = int(config["hidden_size"])
        self.hidden_size = H
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.head_dim = int(config.get("head_dim") or H // self.heads)
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.target_hidden = int(config.get("target_hidden_size") or H)
        ids = aux_layer_ids(config)
        self.num_aux = int(config.get("num_aux_hidden_states") or (len(ids) if ids else 3))
        self.aux_ids = ids
        self.head_config = dict(config)  # its ids and hsx marker: hsx.heads.layer_ids.resolve_head_layers
        self.draft_vocab = int(config.get("draft_vocab_size") or target_vocab)
        inter = int(config["intermediate_size"])
        self.norm_before_fc = bool(_eagle_config(config).get("norm_before_fc", config.get("norm_before_fc", False)))
        self.norm_output = bool(config.get("norm_output", False))
        self.fc = nn.Linear(self.target_hidden * self.num_aux, H, bias=bool(config.get("bias", False)))
        self.input_norm = _RMSNorm(self.target_hidden * self.num_aux, eps) if self.norm_before_fc else None
        self.input_layernorm = _RMSNorm(H, eps)
        self.hidden_norm = _RMSNorm(H, eps)
        self.q_proj = nn.Linear(2 * H, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, H, bias=False)
        self.post_attention_layernorm = _RMSNorm(H, eps)
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.norm = _RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, self.draft_vocab, bias=False)
        self.register_buffer("hot", torch.arange(self.draft_vocab), persistent=False)  # draft id -> target id
        self.target_vocab = target_vocab
        rope_cfg = {k: config[k] for k in ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
                                           "partial_rotary_factor") if k in config}
        llama = LlamaConfig(hidden_size=H, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                            head_dim=self.head_dim, **rope_cfg)
        self.rotary = LlamaRotaryEmbedding(llama)
        self._embed = [target_embed]  # the target's embedding, shared (not a parameter of the head)

    # the engine asks for these of every model it drives
    @property
    def dtype(self):
        return self.fc.weight.dtype

    def embed(self, ids):
        return self._embed[0](ids)

    def forward(self, input_ids, position_ids, attention_mask, cache=None, use_cache=True, output_hidden_states=False,
                draft_hidden=None):
        """``input_ids [B, q]`` with ``draft_hidden [B, q, W]``: aux states (W = K * target width, through fc) or
        the head's own outputs (W = H). Returns logits over the target vocabulary (tokens outside the
        draft vocabulary at -inf; lm_head runs when they are first read) and the pre-norm outputs that
        feed the next step."""
        hidden = draft_hidden
        if hidden is None:
            raise HsxError("an EAGLE3 head drafts from hidden states; none were given")
        if hidden.shape[-1] != self.hidden_size:
            if self.input_norm is not None:
                hidden = self.input_norm(hidden)
            hidden = self.fc(hidden)
        B, q, _ = hidden.shape
        residual = hidden
        x = torch.cat([self.input_layernorm(self.embed(input_ids).to(hidden.dtype)), self.hidden_norm(hidden)], -1)
        qs = self.q_proj(x).view(B, q, self.heads, self.head_dim).transpose(1, 2)
        ks = self.k_proj(x).view(B, q, self.kv_heads, self.head_dim).transpose(1, 2)
        vs = self.v_proj(x).view(B, q, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(vs, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        qs = qs * cos + _rotate_half(qs) * sin
        ks = ks * cos + _rotate_half(ks) * sin
        if cache is not None:
            ks, vs = cache.update(ks, vs, 0)
        rep = self.heads // self.kv_heads
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        a = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=attention_mask)
        r = self.o_proj(a.transpose(1, 2).reshape(B, q, -1)) + residual
        m = self.post_attention_layernorm(r)
        out = self.down_proj(torch.nn.functional.silu(self.gate_proj(m)) * self.up_proj(m)) + r
        normed = self.norm(out)
        return _Out(self, normed, normed if self.norm_output else out)

    def target_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[B, q, target vocab]`` logits of the final norm's output ``normed [B, q, H]``: the draft
        vocabulary's through lm_head, every other token at -inf."""
        draft_logits = self.lm_head(normed)
        logits = draft_logits.new_full((*normed.shape[:2], self.target_vocab), float("-inf"))
        logits[..., self.hot] = draft_logits
        return logits


def _check_config(path: Path, config: dict, tcfg, model_type: str | None = None) -> None:
    where = f"EAGLE3 head {str(path)!r}"
    V, L, Ht = int(tcfg.vocab_size), int(tcfg.num_hidden_layers), int(tcfg.hidden_size)
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise HsxError(f"{where}: num_hidden_layers = {config.get('num_hidden_layers')}; one layer (midlayer) is supported")
    for flag in ("fc_norm", "use_aux_norm"):
        if config.get(flag):
            raise HsxError(f"{where}: {flag} (per-chunk aux norms) is not supported")
    if config.get("tie_word_embeddings"):
        raise HsxError(f"{where}: tie_word_embeddings = true (lm_head = the target's embedding) is not supported")
    if config.get("draft_vocab_size") is None:
        raise HsxError(f"{where}: no draft_vocab_size in config.json (a head whose lm_head comes from the target "
                       f"is not supported)")
    want_ht = int(config.get("target_hidden_size") or config["hidden_size"])
    hc = int(getattr(tcfg, "hc_mult", None) or 1)  # hyper-connections: an aux state is all hc_mult streams
    if want_ht != Ht * hc:
        streams = "" if hc == 1 else f" x hc_mult {hc} = {Ht * hc} (an aux state is all its streams)"
        raise HsxError(f"{where}: target_hidden_size {want_ht} but the target's hidden_size is {Ht}{streams}")
    if int(config.get("vocab_size", V)) != V:
        raise HsxError(f"{where}: vocab_size {config.get('vocab_size')} but the target's vocabulary is {V}")
    ids = aux_layer_ids(config)
    try:
        marker = head_marker(config)
        rule = marker[RULE_KEY] if marker else HF_READING.rule
        top = L - 1 if rule == "sglang" else L  # SGLang's ids name blocks 0..L-1, vLLM's boundaries 0..L
        if ids is not None and (len(ids) == 0 or any(not 0 <= i <= top for i in ids)):
            raise HsxError(f"eagle_aux_hidden_state_layer_ids {ids} outside 0..{top} for a {L}-layer target "
                           f"({rule} rule{'' if marker else ', no hsx marker'})")
        resolve_head_layers(config, HF_READING, model_type, L)
    except HsxError as e:
        raise HsxError(f"{where}: {e}") from None


def _expected(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the head's parameter it fills."""
    params = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight}
    if head.fc.bias is not None:
        params["fc.bias"] = head.fc.bias
    if head.input_norm is not None:
        params["input_norm.weight"] = head.input_norm.weight
    for k in _LAYER:
        params[k] = head.get_parameter(k.removeprefix("midlayer.").replace("self_attn.", "").replace("mlp.", ""))
    return params


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HsxError(f"EAGLE3 head {str(path)!r}: no *.safetensors weights")
    return files


def _check_weights(path: Path, head: Eagle3Head, shapes: dict[str, tuple]) -> None:
    where = f"EAGLE3 head {str(path)!r}"
    params = _expected(head)
    missing = sorted(set(params) - set(shapes))
    if "d2t" not in shapes and head.draft_vocab != head.target_vocab:
        missing.append("d2t")
    unexpected = sorted(set(shapes) - set(params) - {"d2t", *_IGNORED})
    wrong = [f"{k} (checkpoint {tuple(shapes[k])}, head {tuple(p.shape)})" for k, p in params.items()
             if k in shapes and tuple(shapes[k]) != tuple(p.shape)]
    if "d2t" in shapes and tuple(shapes["d2t"]) != (head.draft_vocab,):
        wrong.append(f"d2t (checkpoint {tuple(shapes['d2t'])}, draft_vocab_size {head.draft_vocab})")
    if missing or unexpected or wrong:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) \
            + ([f"wrong shape: {', '.join(wrong)}"] if wrong else [])
        raise HsxError(f"{where}: weights do not match its config: " + "; ".join(parts))


def _build(path: Path, target_config, target_embed) -> tuple[Eagle3Head, dict]:
    config = json.loads((path / "config.json").read_text())
    tcfg = target_config.get_text_config(decoder=True)
    _check_config(path, config, tcfg, getattr(target_config, "model_type", None))
    head = Eagle3Head(config, target_embed, int(tcfg.vocab_size), str(path))
    if head.target_hidden * head.num_aux == head.hidden_size:
        raise HsxError(f"EAGLE3 head {str(path)!r}: {head.num_aux} aux states of width {head.target_hidden} are as "
                       f"wide as the head ({head.hidden_size}); SGLang would skip fc on them")
    return head, config


def check_eagle3_head(path: str | Path, target_config) -> None:
    """Every check :func:`load_eagle3_head` makes that needs no weights read (shapes from the file headers)."""
    from safetensors import safe_open

    path = Path(path)
    with torch.device("meta"):
        head, _ = _build(path, target_config, None)
    shapes = {}
    for f in _weight_files(path):
        with safe_open(str(f), "pt") as sf:
            shapes.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
    _check_weights(path, head, shapes)


def load_eagle3_head(path: str | Path, target, dtype: torch.dtype) -> Eagle3Head:
    """Build and fill a head for ``target`` (a transformers causal LM); refuse anything it cannot run exactly."""
    from safetensors import safe_open

    path = Path(path)
    where = f"EAGLE3 head {str(path)!r}"
    head, _ = _build(path, target.config, target.get_input_embeddings())
    V = head.target_vocab
    weights = {}
    for f in _weight_files(path):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                weights[k] = sf.get_tensor(k)
    _check_weights(path, head, {k: tuple(v.shape) for k, v in weights.items()})
    params = _expected(head)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(weights[k].to(p.dtype))
        if "d2t" in weights:
            hot = torch.arange(head.draft_vocab) + weights["d2t"].to(torch.long).reshape(-1)
            if int(hot.min()) < 0 or int(hot.max()) >= V:
                raise HsxError(f"{where}: d2t maps draft ids to target ids outside 0..{V - 1}")
            if hot.unique().numel() != hot.numel():
                raise HsxError(f"{where}: d2t maps two draft ids to the same target id")
            head.hot = hot
    return head.to(dtype).eval()
