"""DeepSeek-V4's compressed attention in the transformers engine: a rejected draft must leave no trace in a
compressor's state.

A compressed layer closes a window of ``compress_rate`` tokens into one entry that every later query of
the row may attend to; a verify step feeds the compressor the root and every draft, so a rejected draft
that closed a window (or sits in the open one) would move every later row of that request, silently.
The engine keeps a transformers cache layer of the kind per row and, at a commit that drops tokens,
puts the row back to its state before the step and runs the compressor again over the kept tokens
(hsx.engine.hf.compressed). Here that state is compared with transformers' own cache after a forward
over the accepted tokens alone, per layer and per row, with a control that keeps the rejected drafts
and must differ; then runs drafted by an EAGLE3 head, prefilled in chunks, under continuous batching,
and the lightning indexer's ties.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from families import VOCAB, build, cached
from hsx.demo.models import perturbed_copy
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings
from hsx.engine.hf.capture import Driven
from hsx.engine.hf.kv import KV
from hsx.heads.load import Eagle3Head
from test_families import check_oracle, groups_for, prompts

# rates 4 (heavily compressed, blocks 0-2) and 2 (compressed sparse, block 3): the prompt's 6 tokens leave a
# window of 4 open at 4, 5; the root (position 6) and drafts 7, 8, 9 close it at 7 and open the next one
PROMPT, DRAFTS = 6, 4
KEPT = (1, 2, 4, 3)  # per row: only the root, one draft (closes a window), all of them, two


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _state(layer) -> dict:
    """A transformers compressed cache layer's state by name: entries, the open window, counts, overlap."""
    out = {}
    for attr in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate", "entry_count"):
        for name, value in (getattr(layer, attr, None) or {}).items():
            out[f"{attr}.{name}"] = value
    return out


def _fresh(model, ids: torch.Tensor) -> dict:
    """transformers' own forward over ``ids`` alone: each compressed layer's state after it."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None], cache=cache, use_cache=True)
    return {i: _state(layer) for i, layer in enumerate(cache.layers) if hasattr(layer, "compressed_kv")}


def _verify_step(model, kept):
    """A batch of len(kept) rows: prefill, one verify forward of DRAFTS tokens, a commit keeping ``kept`` of them."""
    batch = len(kept)
    ids = torch.randint(0, VOCAB, (batch, PROMPT + DRAFTS), generator=torch.Generator().manual_seed(7))
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


def _diff(got, want) -> float:
    if isinstance(want, int):
        return 0.0 if got == want else float("inf")
    if want is None or got is None:
        return 0.0 if got is None and want is None else float("inf")
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30) if want.numel() else 0.0


def test_a_rejecting_verify_leaves_the_compressor_state_of_the_accepted_tokens_alone():
    model = cached("deepseek_v4")
    ids, kv = _verify_step(model, KEPT)
    layers = [layer for layer in kv.cache.layers if hasattr(layer, "rows")]
    assert [layer.layer_idx for layer in layers] == [0, 1, 2, 3]
    worst, checked = 0.0, 0
    for b, k in enumerate(KEPT):
        want = _fresh(model, ids[b, : PROMPT + k])
        for layer in layers:
            got = _state(layer.rows[b])
            assert set(got) == set(want[layer.layer_idx]), layer.layer_idx
            for name, ref in want[layer.layer_idx].items():
                diff = _diff(got[name], ref)
                assert diff <= 1e-5, (b, layer.layer_idx, name, diff)  # fp32, batched vs alone
                worst, checked = max(worst, diff), checked + 1
    assert checked > 50
    # the control: keeping every draft gives states the accepted tokens alone do not (the check can fail)
    _, everything = _verify_step(model, (DRAFTS,) * len(KEPT))
    want = _fresh(model, ids[0, : PROMPT + KEPT[0]])
    moved = [name for layer in everything.cache.layers if hasattr(layer, "rows")
             for name, ref in want[layer.layer_idx].items() if _diff(_state(layer.rows[0])[name], ref) > 1e-3]
    assert any(n.startswith("compressed_kv") for n in moved) and any(n.startswith("entry_count") for n in moved), moved


def _random_head(model, seed: int = 0) -> Eagle3Head:
    # the head reads three boundaries of all 4 streams: SGLang's spec_hidden_size, hidden_size * hc_mult
    hidden = model.config.hidden_size
    config = {"hidden_size": hidden, "target_hidden_size": hidden * model.config.hc_mult, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 2 * hidden,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Eagle3Head(config, model.get_input_embeddings(), VOCAB).float().eval()


@pytest.mark.parametrize("chunk", [None, 3])
def test_an_eagle3_head_and_a_draft_model_draft_chains_past_the_windows(chunk):
    model = cached("deepseek_v4")
    groups = groups_for(model)
    reqs = prompts((1, 6, 14), seed=9)
    for draft in (_random_head(model), perturbed_copy(model, scale=0.05, seed=1)):
        eng = HFEngine(model, groups, draft_model=draft, spec=SpecSettings(3, 1, 4), store_dtype=torch.float32,
                       prefill_chunk=chunk)
        samples = eng.generate(reqs, SamplingSettings(max_new_tokens=10))
        for sample in samples:
            check_oracle(model, sample, groups, False)
        accepts = torch.cat([s.accept_lens for s in samples]).long()
        assert bool((accepts == 1).any()), accepts  # drafts rejected, so the rollback ran


def test_continuous_batching_hands_a_finished_row_to_a_waiting_request():
    # two rows, five requests: a waiting request takes a finished one's row, its compressor states copied into it
    model = cached("deepseek_v4")
    eng = HFEngine(model, groups_for(model), draft_model=perturbed_copy(model, 0.05, 1), spec=SpecSettings(3, 1, 4),
                   store_dtype=torch.float32)
    reqs = prompts((6, 6, 3, 9, 6), seed=10)
    done = dict(eng.stream(reqs, SamplingSettings(max_new_tokens=8), slots=2))
    assert set(done) == {rid for rid, _ in reqs} and eng.stats.admissions >= 4, eng.stats
    for rid, sample in done.items():
        check_oracle(model, sample, eng.groups, False, name=rid)


def _own_decode_final(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """lm_head's input from transformers' own cached decode: the prompt in one forward, then a token at a time."""
    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        for start, stop in [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids.numel() - 1)]:
            out.append(model(input_ids=ids[None, start:stop], position_ids=torch.arange(start, stop)[None],
                             cache=cache, use_cache=True, output_hidden_states=True).hidden_states[-1][0])
    return torch.cat(out)


def test_deepseek_v4_indexer_ties_make_its_own_decode_differ_from_its_own_forward():
    # index_topk 4 < the entries of a 16-token sequence: the indexer picks, and a tie of zero scores (its ReLU) is
    # broken by the length of the list it sorts, which grows during a decode. The engine's rows equal transformers'
    # own cached decode; that decode and the full forward differ where a tie fell differently
    model = build("deepseek_v4", index_topk=4)
    groups = groups_for(model)
    eng = HFEngine(model, groups, store_dtype=torch.float32)
    (sample,) = eng.generate(prompts((6,)), SamplingSettings(max_new_tokens=10))
    own = _own_decode_final(model, sample.input_ids, 6)
    scale = float(own.abs().max())
    assert float((sample.hidden["final"] - own).abs().max()) <= 1e-5 * scale
    with torch.no_grad():
        full = model(input_ids=sample.input_ids[None], output_hidden_states=True).hidden_states[-1][0][:-1]
    assert float((own - full).abs().max()) > 1e-3 * scale  # the model's two forms disagree: not the engine's doing


def test_an_eagle3_head_config_names_the_streams_width_of_its_aux_states():
    from pathlib import Path

    from hsx.errors import HsxError
    from hsx.heads.load import _check_config

    tcfg = cached("deepseek_v4").config
    config = {"hidden_size": 64, "target_hidden_size": 256, "draft_vocab_size": VOCAB, "vocab_size": VOCAB,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    _check_config(Path("head"), config, tcfg)  # three boundaries of 4 x 64: SGLang's spec_hidden_size
    with pytest.raises(HsxError, match=r"target_hidden_size 64 but the target's hidden_size is 64 x hc_mult 4 = 256"):
        _check_config(Path("head"), {**config, "target_hidden_size": 64}, tcfg)
