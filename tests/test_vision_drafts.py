"""Speculative decoding on vision-language targets (hsx.engine.hf.vision_drafts): every stored row against an
independent teacher-forced forward of the target over the final tokens with the same pixels (the oracle of
tests/vl_models.py), the stored positions against the model's rope index, greedy tokens against plain greedy
decoding, for a draft model and an EAGLE3 head, batched and alone, with drafts mostly rejected and all accepted."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from hsx.data.render import Renderer
from hsx.engine.hf.engine import SamplingSettings, SpecSettings
from hsx.engine.hf.vision import VisionEngine, load_vision_target
from hsx.errors import HsxError
from test_families import random_head
from test_vision import check_rows, groups_of, rows
from vl_models import build_vl, draw

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "gemma3")
CHAINS = {"k1": SpecSettings(num_steps=1, topk=1, num_draft_tokens=2),
          "k3": SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)}
MAX_NEW = 8


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    return {"a": draw(d / "a.png", 64, 96, 1), "b": draw(d / "b.png", 120, 50, 2), "c": draw(d / "c.jpg", 56, 28, 3)}


@functools.cache
def target(family: str, root: str):
    torch.set_num_threads(1)
    from pathlib import Path

    path = build_vl(family, Path(root) / family)
    model, tok, processor, spec = load_vision_target(str(path), torch.float32)
    return SimpleNamespace(family=family, path=path, model=model, tok=tok, processor=processor, spec=spec)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vl_targets"))


def text_twin(t):
    """A text causal LM holding the target's language model and lm_head: on text tokens at 1-D positions (all
    three mRoPE axes equal) it is the target, so it drafts what the target chooses there."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if t.family == "gemma3":  # its text config is a causal LM's own (sliding layers, scaled embeddings and all)
        return _twin_of(t, t.model.config.get_text_config(decoder=True))
    text = t.model.config.get_text_config(decoder=True).to_dict()
    cls = {"qwen2_5_vl": Qwen2Config, "qwen2_vl": Qwen2Config, "qwen3_vl": Qwen3Config, "qwen3_vl_moe": Qwen3MoeConfig,
           "llava": LlamaConfig}[t.family]
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "max_position_embeddings", "attention_bias",
            "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers")
    # Qwen3-VL-MoE's router always renormalizes its top-k weights; Qwen3-MoE's does so with norm_topk_prob
    moe = {"norm_topk_prob": True} if t.family == "qwen3_vl_moe" else {}
    config = cls(**{k: text[k] for k in keep if k in text}, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0},
                 tie_word_embeddings=False, **moe)
    return _twin_of(t, config)


def _twin_of(t, config):
    """A causal LM of ``config`` holding the target's language model and lm_head."""
    from transformers import AutoModelForCausalLM

    twin = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    state = {f"model.{k}": v for k, v in t.model.model.language_model.state_dict().items()}
    state["lm_head.weight"] = t.model.lm_head.weight
    missing, unexpected = twin.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return twin


def random_draft(t):
    from hsx.demo.models import build_tiny_llama

    return build_tiny_llama(2, 64, int(t.model.config.get_text_config(decoder=True).vocab_size), seed=123).float().eval()


def draft_of(t, kind: str):
    if kind == "head":
        return random_head(t.model, vocab=int(t.model.config.get_text_config(decoder=True).vocab_size))
    return text_twin(t) if kind == "twin" else random_draft(t)


def run(t, images, draft, chain, batched: bool, stops=None, temperature: float = 0.0):
    renderer = Renderer(t.tok, "generate", vision=(t.spec, t.processor))
    prompts = [renderer.render(r, i) for i, r in enumerate(rows(images))]
    sampling = SamplingSettings(max_new_tokens=MAX_NEW, temperature=temperature, seed=3,
                                stop_token_ids=(t.tok.eos_token_id,) if stops is None else stops)
    batches = [prompts] if batched else [[p] for p in prompts]
    engine = VisionEngine(t.model, groups_of(t), t.spec, store_dtype=torch.float32, draft_model=draft,
                          spec_settings=chain)
    plain = VisionEngine(t.model, groups_of(t), t.spec, store_dtype=torch.float32)
    got = [s for b in batches for s in engine.generate(b, sampling)]
    want = [s for b in batches for s in plain.generate(b, sampling)]
    return prompts, got, want, engine


@pytest.mark.parametrize("batched", [True, False], ids=["batch3", "batch1"])
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("kind", ["random", "twin", "head"])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_rows_match_a_teacher_forced_forward(family, kind, chain, batched, images, root):
    t = target(family, root)
    spec = CHAINS[chain]
    prompts, got, want, engine = run(t, images, draft_of(t, kind), spec, batched)
    assert [len(p.vision.images) for p in prompts] == [1, 0, 2]
    for prompt, vs, plain in zip(prompts, got, want, strict=True):
        assert torch.equal(vs.sample.input_ids, plain.sample.input_ids), prompt.sample_id  # greedy: the same tokens
        assert torch.equal(vs.positions, plain.positions) and vs.rope_delta == plain.rope_delta
        a = vs.sample.accept_lens.long()
        completion = vs.sample.input_ids.numel() - vs.sample.prompt_len
        assert bool(((a >= 1) & (a <= spec.num_draft_tokens)).all())
        assert int(a.sum()) >= completion - 1 and (int(a[:-1].sum()) < completion - 1 if len(a) else completion == 1)
        check_rows(t, prompt, vs, engine.groups, "generate")
    accept = torch.cat([vs.sample.accept_lens for vs in got]).long()
    text_only = got[1].sample.accept_lens.long()
    if kind == "random":
        assert float((accept == 1).float().mean()) >= 0.8, accept  # drafts mostly rejected
    elif kind == "twin":
        assert bool((text_only == spec.num_draft_tokens).all()), text_only  # the target itself: all accepted


def blind(t):
    """A copy of the target ``t`` whose vision projector outputs the placeholder's token embedding at every image
    token: its merged embeddings are the text embeddings of the ids, what a text draft sees. On LLaVA (1-D
    positions) its text twin is then the target itself on every row; on Qwen2.5-VL the image tokens' mRoPE
    positions still differ from the twin's."""
    import copy

    model = copy.deepcopy(t.model)
    last = model.model.multi_modal_projector.linear_2 if t.family == "llava" else model.model.visual.merger.mlp[2]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.copy_(model.get_input_embeddings().weight[t.spec.image_token_id])
    return SimpleNamespace(**{**vars(t), "model": model})


@pytest.mark.parametrize("batched", [True, False], ids=["batch3", "batch1"])
@pytest.mark.parametrize("regime", ["twin", "perturbed"])
@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_image_rows_accept_drafts_of_a_draft_that_sees_what_the_target_sees(family, regime, batched, images, root):
    """Drafts accepted at image rows too, all of them or some (rows of one batch accepting different counts)."""
    from hsx.demo.models import perturbed_copy

    t = blind(target(family, root))
    twin = text_twin(t)
    spec = CHAINS["k3"]
    draft = twin if regime == "twin" else perturbed_copy(twin, scale=0.05, seed=1)
    prompts, got, want, engine = run(t, images, draft, spec, batched)
    for prompt, vs, plain in zip(prompts, got, want, strict=True):
        assert torch.equal(vs.sample.input_ids, plain.sample.input_ids), prompt.sample_id
        check_rows(t, prompt, vs, engine.groups, "generate")
    accept = [vs.sample.accept_lens.long() for vs in got]
    if regime == "twin" and family == "llava":
        assert all(bool((a == spec.num_draft_tokens).all()) for a in accept), accept  # the target itself
    elif regime == "twin":
        assert float(torch.cat(accept).float().mean()) >= 2, accept  # mostly accepted
    else:
        assert len({tuple(a.tolist()) for a in accept}) > 1, accept  # the rows accepted differently


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_sampled_rows_match_a_teacher_forced_forward(family, images, root):
    """Sampling (one seeded target sample per verify position, a draft accepted when it equals the sample at its
    parent): every row equals the oracle's over the tokens sampled."""
    t = blind(target(family, root))
    prompts, got, _, engine = run(t, images, text_twin(t), CHAINS["k3"], True, temperature=0.3)
    for prompt, vs in zip(prompts, got, strict=True):
        check_rows(t, prompt, vs, engine.groups, "generate")
    assert int(torch.cat([vs.sample.accept_lens for vs in got]).max()) > 1


def test_a_stop_token_inside_an_accepted_chain_ends_the_sample_there(images, root):
    t = target("llava", root)
    renderer = Renderer(t.tok, "generate", vision=(t.spec, t.processor))
    prompt = renderer.render(rows(images)[1], 1)
    plain = VisionEngine(t.model, groups_of(t), t.spec, store_dtype=torch.float32)
    ref = plain.generate([prompt], SamplingSettings(max_new_tokens=MAX_NEW))[0].sample
    stop = int(ref.input_ids[ref.prompt_len + 2])  # the third completion token
    prompts, got, want, engine = run(t, images, text_twin(t), CHAINS["k3"], True, stops=(stop,))
    for prompt, vs, p in zip(prompts, got, want, strict=True):
        assert torch.equal(vs.sample.input_ids, p.sample.input_ids)
        check_rows(t, prompt, vs, engine.groups, "generate")
    assert got[1].sample.finish_reason == "stop" and int(got[1].sample.input_ids[-1]) == stop


def test_the_oracle_catches_verify_steps_at_the_wrong_rope_delta(images, root, monkeypatch):
    """Negative control: verify steps one position off (a wrong rope_delta) move the rows past the tolerance
    (measured 0.13 on Qwen2.5-VL, 0.46 on Qwen3-VL, relative to the largest value; correct rows: up to 7.6e-7)."""
    import hsx.engine.hf.vision_drafts as vd

    right = vd.verify_positions
    monkeypatch.setattr(vd, "verify_positions", lambda root_pos, depth, mrope: right(root_pos + 1, depth, mrope))
    t = target("qwen2_5_vl", root)
    prompts, got, _, engine = run(t, images, random_draft(t), CHAINS["k3"], True)
    failed = 0
    for prompt, vs in zip(prompts, got, strict=True):
        with pytest.raises(AssertionError, match="relative error"):
            check_rows(t, prompt, vs, engine.groups, "generate")
        failed += 1
    assert failed == 3


def test_what_is_not_run_with_a_draft_is_refused_before_the_first_forward(root):
    t = target("qwen2_5_vl", root)
    with pytest.raises(HsxError, match=r"vision-language target \(qwen2_5_vl\): draft trees \(topk 4\) are not run"):
        VisionEngine(t.model, groups_of(t), t.spec, draft_model=random_draft(t),
                     spec_settings=SpecSettings(num_steps=3, topk=4, num_draft_tokens=8))
    from hsx.demo.models import build_tiny_llama

    with pytest.raises(HsxError, match="draft vocab 100 != vision-language target's text vocab"):
        VisionEngine(t.model, groups_of(t), t.spec, draft_model=build_tiny_llama(2, 64, 100))
    with pytest.raises(HsxError, match="speculative settings given without a draft model"):
        VisionEngine(t.model, groups_of(t), t.spec, spec_settings=CHAINS["k3"])


def save_head(head, out):
    """``head`` in SGLang's EAGLE3 format under ``out``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from hsx.heads.load import _expected

    out = Path(out)
    out.mkdir(parents=True)
    config = {**head.head_config, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "draft_vocab_size": head.draft_vocab, "vocab_size": head.target_vocab,
              "target_hidden_size": head.target_hidden}
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: p.detach().contiguous() for k, p in _expected(head).items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("kind", ["twin", "head"])
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "llava", "gemma3"])
def test_extract_with_a_draft_stores_rows_that_match_the_oracle(family, kind, images, root, tmp_path):
    """``hsx extract --draft-model`` on a vision-language target: the speculative and vision records, the tokens
    of plain greedy decoding, every row (the head's eagle3 column included) its teacher-forced forward's."""
    import json

    import hsx
    from hsx.config import ExtractConfig
    from hsx.run.pipeline import extract
    from vl_models import oracle

    t = target(family, root)
    draft = draft_of(t, kind)
    if kind == "head":
        draft_path = save_head(draft, tmp_path / "head")
    else:
        draft.save_pretrained(tmp_path / "twin")
        draft_path = tmp_path / "twin"
    data = [{"id": f"r{i}", **r} for i, r in enumerate(rows(images))]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    layers = "0,2,final" + (",eagle3" if kind == "head" else "")
    cfg = ExtractConfig(model=str(t.path), dataset=str(path), output=str(tmp_path / "out"), id_field="id",
                        dtype="float32", model_dtype="float32", layers=layers, mode="generate", max_new_tokens=6,
                        batch_size=3, draft_model=str(draft_path), spec_num_steps=3)
    summary = extract(cfg, progress=False)
    assert (summary.samples, summary.errors) == (3, 0)
    ds = hsx.open(tmp_path / "out")
    record = ds.metadata["speculative"]
    assert record["algorithm"] == ("EAGLE3" if kind == "head" else "draft-model") and record["num_draft_tokens"] == 4
    assert ds.metadata["vision"]["draft_at_image_tokens"].startswith("placeholder token embeddings")
    renderer = Renderer(t.tok, "generate", vision=(t.spec, t.processor))
    prompts = [renderer.render(r, i) for i, r in enumerate(rows(images))]
    sampling = SamplingSettings(max_new_tokens=6, stop_token_ids=(t.tok.eos_token_id,))
    plain = VisionEngine(t.model, groups_of(t), t.spec, store_dtype=torch.float32).generate(prompts, sampling)
    by_id = {s.sample_id: s for s in ds}
    for i, (prompt, p) in enumerate(zip(prompts, plain, strict=True)):
        sample = by_id[f"r{i}"]
        ids = torch.as_tensor(sample.input_ids).long()
        assert torch.equal(ids, p.sample.input_ids)
        assert sample.accept_lens is not None and len(sample.accept_lens) > 0
        norm_input = {}  # boundary L: the final norm's input (the oracle's last entry is the norm's output)
        hook = t.model.model.language_model.norm.register_forward_pre_hook(
            lambda m, args: norm_input.__setitem__("x", args[0][0].clone()))
        try:
            hs, _ = oracle(t, prompt, ids)
        finally:
            hook.remove()
        n, num_layers = ids.numel() - 1, len(hs) - 1
        hs = {**dict(enumerate(hs[:num_layers])), num_layers: norm_input["x"][None], "final": hs[num_layers]}
        # the head's ids 0, 1, 2 name the outputs of blocks 0, 1, 2: boundaries 1, 2, 3 (= L)
        sources = {"b0": [0], "b2": [2], "final": ["final"], "eagle3": [1, 2, 3]}
        for name in ("b0", "b2", "final") + (("eagle3",) if kind == "head" else ()):
            want = torch.cat([hs[b][0, :n] for b in sources[name]], -1)
            err = (sample.hidden(name).float() - want).abs().max().item() / want.abs().max().item()
            assert err < 1e-5, (f"r{i}", name, err)
    from typer.testing import CliRunner

    from hsx.cli import app

    result = CliRunner().invoke(app, ["verify", "--recompute", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
