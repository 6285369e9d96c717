"""The lane's target and EAGLE/EAGLE3 drafts do what hsx.demo.spec_models says, checked without SGLang.

The draft heads are evaluated here by hand from their safetensors (one step: the block with its
zero attention output, the lookup MLP, the head), which is all the regimes depend on; SGLang's own
acceptance on them is measured by the real-SGLang grid.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hsx.demo.spec_models import EAGLE3_IDS, REGIMES, build_spec_models


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    models = build_spec_models(tmp_path_factory.mktemp("spec"))
    target = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    return models, target


def rms(x):
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


def lookup_step(w: dict, prefix: str, h: torch.Tensor) -> torch.Tensor:
    """h + MLP(RMSNorm(h)): the draft block when its attention output is zero."""
    u = rms(h)
    gate, up, down = (w[f"{prefix}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    return h + (F.silu(u @ gate.T) * (u @ up.T)) @ down.T


def sigma_of(target, ids: torch.Tensor) -> torch.Tensor:
    E = target.model.embed_tokens.weight
    return (E[ids] @ target.lm_head.weight.T).argmax(-1)


def test_classes_partition_ordinary_tokens_and_sigma_keeps_them(built):
    models, target = built
    all_ids = sum(models.classes.values(), [])
    assert len(all_ids) == len(set(all_ids)) and min(len(v) for v in models.classes.values()) > 100
    with torch.no_grad():
        for regime in REGIMES:
            ids = torch.tensor(models.classes[regime])
            assert set(sigma_of(target, ids).tolist()) == set(ids.tolist()), regime


@pytest.mark.parametrize("length", [1, 40, 300])
def test_target_greedy_follows_sigma_in_context(built, length):
    models, target = built
    g = torch.Generator().manual_seed(length)
    pool = torch.tensor(sum(models.classes.values(), []))
    ids = pool[torch.randint(len(pool), (length,), generator=g)]
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
        assert torch.equal(out.logits[0].argmax(-1), sigma_of(target, ids))
        # the blocks still read the context: the states are not just the embeddings
        E = target.model.embed_tokens.weight[ids]
        assert float((out.hidden_states[6][0] - E).norm(dim=-1).mean() / E.norm(dim=-1).mean()) > 0.1


def test_stop_cycle_reaches_eos_in_two_steps(built):
    models, target = built
    eos = target.config.eos_token_id
    with torch.no_grad():
        q = sigma_of(target, torch.tensor([models.stop_prompt_tail]))
        assert int(sigma_of(target, sigma_of(target, q))[0]) == eos


def draft_hits(models, target, kind: str) -> dict[str, float]:
    """Per regime: share of tokens x whose one-step draft proposal is the target's next-next token."""
    root = models.eagle if kind == "eagle" else models.eagle3
    w = load_file(str(root / "model.safetensors"))
    E = target.model.embed_tokens.weight
    out = {}
    with torch.no_grad():
        for regime in REGIMES:
            x = torch.tensor(models.classes[regime])
            if kind == "eagle":  # fc passes E[token]; SGLang shares the target's lm_head
                h = lookup_step(w, "layers.0", E[x] @ w["fc.weight"][:, :E.shape[1]].T)
                proposal = (h @ target.lm_head.weight.T).argmax(-1)
                want = sigma_of(target, x)
            else:  # fc passes boundary 2; head in the draft's own (permuted) vocabulary, mapped by d2t
                state = target(x[:, None], output_hidden_states=True).hidden_states[EAGLE3_IDS[0] + 1][:, 0]
                h = lookup_step(w, "midlayer", state @ w["fc.weight"][:, :E.shape[1]].T)
                draft_id = (rms(h) @ w["lm_head.weight"].T).argmax(-1)
                proposal = draft_id + w["d2t"][draft_id]
                want = sigma_of(target, sigma_of(target, x))
            out[regime] = float((proposal == want).float().mean())
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_draft_regimes(built, kind):
    models, target = built
    hits = draft_hits(models, target, kind)
    assert hits["follow"] == 1.0
    assert 0.35 < hits["mixed"] < 0.65
    assert hits["miss"] == 0.0


def test_draft_formats_are_sglangs(built):
    models, _ = built
    e3 = json.loads((models.eagle3 / "config.json").read_text())
    assert e3["architectures"] == ["LlamaForCausalLMEagle3"]
    assert e3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == EAGLE3_IDS
    w = load_file(str(models.eagle3 / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight"} <= set(w)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and bool(w["d2t"].ne(0).any())
    e = json.loads((models.eagle / "config.json").read_text())
    assert e["architectures"] == ["LlamaForCausalLMEagle"]
    assert "layers.0.input_layernorm.weight" not in load_file(str(models.eagle / "model.safetensors"))
