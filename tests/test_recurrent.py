"""Recurrent layers in the transformers engine: a rejected draft must leave no trace in their state.

A linear-attention, short-convolution or Mamba-2 layer carries one state per row from token to
token; a verify step feeds it the root and every draft, and a rejected draft that stayed in the
state would move every later row of that request, silently. The engine records the state after
each token of such a forward and gives each row the one after its accepted tokens
(hsx.engine.hf.state). Here that state is compared with transformers' own forward over the
accepted tokens alone, per layer and per row, with a control that keeps the rejected drafts and
must differ; then whole runs against the oracle past every chunk of the recurrence, prefilled in
chunks, drafted by an EAGLE3 head, under continuous batching (a waiting request takes a finished
row); then what is refused.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from families import RECURRENT, RECURRENT_REL_TOL, VOCAB, cached
from hsx.align import ModelShape, parse_layers
from hsx.demo.models import perturbed_copy
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings
from hsx.engine.hf.capture import Driven
from hsx.engine.hf.kv import KV
from hsx.errors import HsxError
from test_families import check_oracle, groups_for, prompts, random_head

PROMPT, DRAFTS = 7, 4  # a verify step of the root and 3 drafts
KEPT = (1, 2, 4, 3)  # per row: only the root, one draft, all of them, two


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _states(layer) -> dict:
    """A recurrent cache layer's tensors by name, ``[B, ...]`` each."""
    out = {}
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            out[f"conv{i}"] = layer.conv_states[i][..., -layer.conv_kernel_size[i]:]
        if layer.is_recurrent_states_initialized[i]:
            out[f"recurrent{i}"] = layer.recurrent_states[i]
    return out


def _fresh(model, ids: torch.Tensor) -> dict:
    """transformers' own forward over ``ids`` alone: each recurrent layer's states after it."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None], cache=cache, use_cache=True)
    return {i: _states(layer) for i, layer in enumerate(cache.layers) if i in _recurrent_layers(cache)}


def _recurrent_layers(cache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if hasattr(layer, "recurrent_states")]


def _verify_step(model, kept):
    """A batch of len(kept) rows: prefill, one verify forward of DRAFTS tokens, a commit keeping ``kept`` of them."""
    batch = len(kept)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (batch, PROMPT + DRAFTS), generator=gen)
    kv = KV(Driven.of(model, "target"), batch, torch.device("cpu"), PROMPT + DRAFTS)
    with torch.inference_mode():
        for part, partial in ((slice(0, PROMPT), False), (slice(PROMPT, PROMPT + DRAFTS), True)):
            q = part.stop - part.start
            positions = torch.arange(part.start, part.stop).expand(batch, -1)
            block = torch.ones(q, q, dtype=torch.bool).tril().expand(batch, -1, -1)
            kv.run(ids[:, part], positions, block, partial=partial)
            keep = torch.ones(batch, q, dtype=torch.bool) if not partial else \
                torch.arange(q)[None] < torch.tensor(kept)[:, None]
            kv.commit(keep)
    return ids, kv


@pytest.mark.parametrize("family", RECURRENT)
def test_a_rejecting_verify_leaves_the_state_of_the_accepted_tokens_alone(family):
    model = cached(family)
    ids, kv = _verify_step(model, KEPT)
    layers = _recurrent_layers(kv.cache)
    assert layers, family
    worst = 0.0
    for b, k in enumerate(KEPT):
        want = _fresh(model, ids[b, : PROMPT + k])
        for i in layers:
            got = _states(kv.cache.layers[i])
            assert set(got) == set(want[i]), (family, i)
            for name, ref in want[i].items():
                diff = float((got[name][b] - ref[0]).abs().max()) / float(ref.abs().max())
                assert diff <= RECURRENT_REL_TOL, (family, b, i, name, diff)
                worst = max(worst, diff)
    # the control: keeping every draft gives states the accepted tokens alone do not (the check can fail)
    _, everything = _verify_step(model, (DRAFTS,) * len(KEPT))
    want = _fresh(model, ids[0, : PROMPT + KEPT[0]])
    moved = max(float((_states(everything.cache.layers[i])[name][0] - ref[0]).abs().max() / ref.abs().max())
                for i in layers for name, ref in want[i].items())
    assert moved > 100 * RECURRENT_REL_TOL, (family, moved)


@pytest.mark.parametrize("family", RECURRENT)
def test_long_prompts_past_the_recurrence_chunks_and_chunked_prefill(family):
    # Gated DeltaNet runs its recurrence in chunks of 64 tokens, Mamba-2 here in chunks of 8: a 70-token
    # prompt crosses them; prefill chunks of 16 carry the state from one engine forward to the next
    model = cached(family)
    groups = groups_for(model)
    reqs = prompts((70, 3, 17), seed=8)
    worst = 0.0
    for chunk in (None, 16):
        draft = perturbed_copy(model, scale=0.05, seed=1)
        spec = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
        eng = HFEngine(model, groups, draft_model=draft, spec=spec, store_dtype=torch.float32, prefill_chunk=chunk)
        for sample in eng.generate(reqs, SamplingSettings(max_new_tokens=12)):
            worst = max(worst, check_oracle(model, sample, groups, False, rel=RECURRENT_REL_TOL))
        plain = HFEngine(model, groups, store_dtype=torch.float32, prefill_chunk=chunk)
        for sample, (_, ids) in zip(plain.prefill(reqs), reqs):
            worst = max(worst, check_oracle(model, sample, groups, True, rel=RECURRENT_REL_TOL))
            if chunk is not None:  # and the model's own forward in the same chunks, within fp32 batching noise
                got = sample.hidden["final"]
                want = _own_chunked_final(model, ids, chunk)
                assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), family
    assert worst <= RECURRENT_REL_TOL


def _own_chunked_final(model, ids: torch.Tensor, size: int) -> torch.Tensor:
    """lm_head's input from transformers' own forward of ``ids`` ``size`` tokens at a time through its cache."""
    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        for start in range(0, ids.numel(), size):
            part = ids[None, start: start + size]
            positions = torch.arange(start, start + part.shape[1])[None]
            out.append(model(input_ids=part, position_ids=positions, cache=cache, use_cache=True,
                             output_hidden_states=True).hidden_states[-1][0])
    return torch.cat(out)


@pytest.mark.parametrize("family", RECURRENT)
def test_an_eagle3_head_drafts_chains_for_a_recurrent_target(family):
    model = cached(family)
    eng = HFEngine(model, groups_for(model), draft_model=random_head(model), spec=SpecSettings(3, 1, 4),
                   store_dtype=torch.float32)
    for sample in eng.generate(prompts((5, 11, 2), seed=9), SamplingSettings(max_new_tokens=8)):
        check_oracle(model, sample, eng.groups, False, rel=RECURRENT_REL_TOL)


# ---- refusals ----------------------------------------------------------------------------------

KINDS = {"qwen3_5": ("qwen3_5_text", "'linear_attention'"), "qwen3_next": ("qwen3_next", "'linear_attention'"),
         "lfm2": ("lfm2", "'conv'"), "falcon_h1": ("falcon_h1", "'hybrid'"), "kimi_linear": ("kimi_linear", "'linear_attention'")}


@pytest.mark.parametrize("family", RECURRENT)
def test_trees_and_left_padding_are_refused_naming_the_family_and_the_layer_kind(family):
    model = cached(family)
    name, kind = KINDS[family]
    groups = parse_layers("final", ModelShape.from_config(model.config))
    tree = SpecSettings(num_steps=3, topk=2, num_draft_tokens=6)
    with pytest.raises(HsxError, match=rf"target model \({name}\): {kind} layers keep one state per row, which a "
                                       rf"draft tree's branches cannot share; draft a chain"):
        HFEngine(model, groups, draft_model=perturbed_copy(model, 0.05, 1), spec=tree)
    with pytest.raises(HsxError, match=rf"target model \({name}\): {kind} layers .*cannot share"):
        HFEngine(model, groups, draft_model=random_head(model), spec=tree)
    with pytest.raises(HsxError, match=rf"target model \({name}\): {kind} layers keep a state per row, which left "
                                       rf"padding would enter before the prompt"):
        HFEngine(model, groups, padding_side="left")


def test_a_recurrent_draft_for_an_attention_target_drafts_chains_only():
    target, draft = cached("llama"), cached("lfm2")
    groups = parse_layers("final", ModelShape.from_config(target.config))
    with pytest.raises(HsxError, match=r"draft model \(lfm2\): 'conv' layers keep one state per row"):
        HFEngine(target, groups, draft_model=draft, spec=SpecSettings(num_steps=2, topk=2, num_draft_tokens=4))
    eng = HFEngine(target, groups, draft_model=draft, spec=SpecSettings(3, 1, 4), store_dtype=torch.float32)
    for sample in eng.generate(prompts((4, 9)), SamplingSettings(max_new_tokens=8)):
        check_oracle(target, sample, groups, False)


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_continuous_batching_hands_a_finished_row_to_a_waiting_request(family):
    # two rows, five requests: a waiting request takes a finished one's row, its states copied into it
    # (requests of one prompt length are admitted together, the others one by one)
    model = cached(family)
    eng = HFEngine(model, groups_for(model), draft_model=perturbed_copy(model, 0.05, 1), spec=SpecSettings(3, 1, 4),
                   store_dtype=torch.float32)
    reqs = prompts((6, 6, 3, 9, 6), seed=10)
    done = dict(eng.stream(reqs, SamplingSettings(max_new_tokens=8), slots=2))
    assert set(done) == {rid for rid, _ in reqs} and eng.stats.admissions >= 4, eng.stats
    for rid, sample in done.items():
        check_oracle(model, sample, eng.groups, False, name=rid, rel=RECURRENT_REL_TOL)
