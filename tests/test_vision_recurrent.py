"""Qwen3.5 as a vision-language target: Gated DeltaNet (linear-attention) blocks beside full attention, no
deepstack. A batched prefill pads on the right, after every real token, and is exact; decoding runs each prompt
alone, because a decode step over a right-padded batch would feed the shorter rows' recurrent state their padding.
Every row is checked against a teacher-forced forward of the model (tests/vl_models.py ``oracle``)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from hsx.align import ModelShape, parse_layers
from hsx.data.render import Renderer
from hsx.engine.hf.engine import SamplingSettings
from hsx.engine.hf.vision import VisionEngine, load_vision_target
from hsx.errors import HsxError
from test_vision import TOL, rows
from vl_models import build_vl, draw, oracle

SAMPLING = SamplingSettings(max_new_tokens=6)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    return {"a": draw(d / "a.png", 64, 96, 1), "b": draw(d / "b.png", 120, 50, 2), "c": draw(d / "c.jpg", 56, 28, 3)}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def target(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = build_vl(request.param, tmp_path_factory.mktemp(request.param))
    model, tok, processor, spec = load_vision_target(str(path), torch.float32)
    return SimpleNamespace(family=request.param, path=path, model=model, tok=tok, processor=processor, spec=spec)


def engine_of(t):
    groups = parse_layers("0,1,2,final", ModelShape.from_config(t.model.config.get_text_config()), None)
    return VisionEngine(t.model, groups, t.spec, store_dtype=torch.float32)


def row_errors(t, prompt, vs, n) -> torch.Tensor:
    """``[n]`` the largest relative error of each of the first ``n`` rows over boundaries 0, 1, 2 and final."""
    hs, _ = oracle(t, prompt, vs.sample.input_ids)
    errs = []
    for name, b in (("b0", 0), ("b1", 1), ("b2", 2), ("final", 3)):
        want = hs[b][0, :n]
        errs.append((vs.sample.hidden[name].float() - want).abs().amax(-1) / want.abs().max())
    return torch.stack(errs).amax(0)


def test_qwen3_5_has_no_deepstack(target):
    """transformers' Qwen3.5 vision config has no deepstack_visual_indexes and its language model adds nothing
    after its blocks: boundary b is transformers' hidden_states[b] at every token, image tokens included."""
    t = target
    assert not hasattr(t.model.config.vision_config, "deepstack_visual_indexes") and t.spec.deepstack == 0
    assert t.spec.mrope and t.model.config.get_text_config().layer_types == \
        ["linear_attention", "full_attention", "linear_attention"]


def test_decode_feeds_no_padding_into_the_recurrent_state(target, images):
    """The engine's batched generate decodes each prompt alone: every row matches the oracle. Negative control:
    the same three prompts decoded as one right-padded batch give rows off by order 1 after the shorter prompts,
    and one padding token after a prompt moves a Gated DeltaNet state (its input is zeroed, its decay is not)."""
    t = target
    prompts = [Renderer(t.tok, "generate", vision=(t.spec, t.processor)).render(r, i) for i, r in enumerate(rows(images))]
    assert len({len(p.input_ids) for p in prompts}) == 3
    engine = engine_of(t)
    out = engine.generate(prompts, SAMPLING)
    worst = 0.0
    for p, vs in zip(prompts, out, strict=True):
        assert vs.sample.input_ids.numel() == len(p.input_ids) + SAMPLING.max_new_tokens
        err = row_errors(t, p, vs, vs.sample.input_ids.numel() - 1)
        assert err.max() < TOL, (p.sample_id, err.max())
        worst = max(worst, err.max().item())
    engine.recurrent = ()  # the batched decode the engine does not run on this target
    padded = engine.generate(prompts, SAMPLING)
    longest = max(range(3), key=lambda i: len(prompts[i].input_ids))
    for i, (p, vs) in enumerate(zip(prompts, padded, strict=True)):
        err = row_errors(t, p, vs, vs.sample.input_ids.numel() - 1)
        n = len(p.input_ids)
        assert err[:n].max() < TOL  # the prompt's rows: a causal prefill, exact with right padding
        if i == longest:
            assert err.max() < TOL, err.max()
        else:
            assert err[n:].min() > 1e-2, (p.sample_id, err[n:])
    # one padding token (attention mask 0) after a prompt: transformers zeroes its input, the state still moves
    ids = torch.tensor(prompts[1].input_ids)[None]
    states = []
    for pad in (0, 1):
        cache = DynamicCache(config=t.model.config)
        mask = torch.cat([torch.ones_like(ids), torch.zeros(1, pad, dtype=torch.long)], 1)
        with torch.inference_mode():
            t.model(input_ids=torch.cat([ids, torch.zeros(1, pad, dtype=torch.long)], 1), attention_mask=mask,
                    cache=cache, use_cache=True)
        states.append(cache.get_recurrent_state(0).clone())
    moved = ((states[1] - states[0]).abs().max() / states[0].abs().max()).item()
    assert moved > 0.1, moved
    print(f"{t.family}: worst decode row error {worst:.2e}; one pad moves layer 0's state by {moved:.2f} (relative)")


def test_greedy_tokens_are_the_models_own_decode(target, images):
    t = target
    prompts = [Renderer(t.tok, "generate", vision=(t.spec, t.processor)).render(r, i) for i, r in enumerate(rows(images))]
    for p, vs in zip(prompts, engine_of(t).generate(prompts, SAMPLING), strict=True):
        ids = torch.tensor(p.input_ids)[None]
        extra = {"mm_token_type_ids": (ids == t.spec.image_token_id).int()}
        if p.vision.images:
            extra.update(pixel_values=p.vision.pixel_values, image_grid_thw=p.vision.image_grid_thw)
        with torch.inference_mode():
            want = t.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=SAMPLING.max_new_tokens, **extra)[0, ids.shape[1]:]
        t.model.model.rope_deltas = None
        assert vs.sample.input_ids[ids.shape[1]:].tolist() == want.tolist(), p.sample_id


@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_text_only_rows_run_through_the_vision_path(target, mode):
    """A text dataset on a Qwen3.5 checkpoint: plain text and chats without images, batched with no pixels at all."""
    t = target
    data = [{"text": "plain words with no picture at all"},
            {"messages": [{"role": "user", "content": "a chat without images"}, {"role": "assistant", "content": "ok"}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts, but text only"}]},
                          {"role": "assistant", "content": "yes"}]}]
    prompts = [Renderer(t.tok, mode, vision=(t.spec, t.processor)).render(r, i) for i, r in enumerate(data)]
    assert not any(p.vision.images for p in prompts) and len({len(p.input_ids) for p in prompts}) > 1
    engine = engine_of(t)
    out = engine.prefill(prompts) if mode == "prefill" else engine.generate(prompts, SAMPLING)
    for p, vs in zip(prompts, out, strict=True):
        n = vs.sample.input_ids.numel() - (mode == "generate")
        assert n >= len(p.input_ids)
        err = row_errors(t, p, vs, n)
        assert err.max() < TOL, (p.sample_id, err.max())
        assert torch.equal(vs.positions, torch.arange(vs.sample.input_ids.numel())[None].expand(3, -1))
        assert vs.rope_delta == 0


def test_a_draft_on_a_recurrent_target_is_refused_before_it_loads(target, tmp_path, monkeypatch):
    import hsx.engine.hf.vision
    from hsx.config import ExtractConfig
    from hsx.engine.hf.runner import HFRunner

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(hsx.engine.hf.vision, "load_vision_target", no_load)
    cfg = ExtractConfig(model=str(target.path), dataset="unused.jsonl", output=str(tmp_path / "out"),
                        draft_model=str(tmp_path / "no-draft"), spec_topk=1)
    with pytest.raises(HsxError, match=re.escape(f"vision-language target ({target.family}): speculative decoding is "
                                                 "not run on targets with recurrent layers ('linear_attention')")):
        HFRunner(cfg)
