"""The transformers engine against an oracle: an unbatched, teacher-forced forward of the same model.

The oracle lives here, not in engine code: one sequence, no padding, no cache, no mask,
``output_hidden_states=True`` plus a pre-hook on the final norm. Every stored row of every layer
group must equal it (float32, max |diff| <= 1e-4), whatever the batch, padding, draft tree and
acceptance pattern were.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hsx.align import ModelShape, parse_layers
from hsx.demo.models import build_tiny_llama, build_tiny_qwen2, make_layerskip_draft, perturbed_copy
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings, load_hf_engine
from hsx.errors import HsxError
from oracle import oracle_rows

NUM_LAYERS, HIDDEN, VOCAB = 4, 64, 256
TOL = 1e-4
CHAIN = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
TREE = SpecSettings(num_steps=3, topk=4, num_draft_tokens=8)
BUILDERS = {
    "llama": lambda seed=0: build_tiny_llama(NUM_LAYERS, HIDDEN, VOCAB, seed=seed),
    "qwen2": lambda seed=0: build_tiny_qwen2(NUM_LAYERS, HIDDEN, VOCAB, seed=seed),
    "llama-eager": lambda seed=0: build_tiny_llama(NUM_LAYERS, HIDDEN, VOCAB, seed=seed, attn_implementation="eager"),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: thread hand-offs cost more than the matmuls, badly so on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def target(arch: str):
    return BUILDERS[arch]()


@functools.cache
def draft(arch: str, regime: str):
    if regime == "same":
        return target(arch)
    if regime == "random":
        return BUILDERS[arch](seed=123)
    if regime == "perturbed":
        return perturbed_copy(target(arch), scale=0.4, seed=1)
    raise ValueError(regime)


def groups_for(model):
    # eagle3 ids [0, 2, 3] name layer outputs -> boundaries (1, 3, 4): includes boundary L = 4 (pre-norm)
    return parse_layers("final,eagle3,0,2,4", ModelShape.from_config(model.config), eagle3_ids=[0, 2, 3])


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"r{i}", torch.randint(0, VOCAB, (n,), generator=gen)) for i, n in enumerate(lengths)]


def engine(arch, regime=None, spec=None, padding="right"):
    model = target(arch)
    d = None if regime is None else draft(arch, regime)
    return HFEngine(model, groups_for(model), draft_model=d, spec=spec if d is not None else None,
                    store_dtype=torch.float32, padding_side=padding)


@functools.cache
def plain_greedy(arch: str, lengths: tuple, max_new: int):
    return engine(arch).generate(prompts(lengths), SamplingSettings(max_new_tokens=max_new))


# ---- the oracle ------------------------------------------------------------------------------

def check_oracle(model, sample, groups, teacher_forced=False) -> float:
    """Every stored row equals the oracle; returns the largest difference seen."""
    ref = oracle_rows(model, sample.input_ids, groups)
    n = sample.input_ids.numel()
    rows = n if teacher_forced else n - 1  # generate mode: the last token is never fed back
    worst = 0.0
    for g in groups:
        got = sample.hidden[g.name]
        assert got.shape == (rows, g.width), (g.name, got.shape)
        assert got.dtype == torch.float32
        diff = float((got - ref[g.name][:rows]).abs().max())
        assert diff <= TOL, f"{g.name}: max diff {diff}"
        worst = max(worst, diff)
    return worst


def check_trim(sample, stride):
    """accept_lens tell the same story as the rows: the last step was needed and may overshoot."""
    completion = sample.input_ids.numel() - sample.prompt_len
    a = sample.accept_lens.long()
    assert bool(((a >= 1) & (a <= stride)).all())
    assert int(a.sum()) >= completion - 1  # rows of the verify steps cover the completion...
    assert int(a[:-1].sum()) < completion - 1 if len(a) else completion == 1  # ...and the last step was needed


# ---- generate mode ---------------------------------------------------------------------------

@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("mode", ["plain", "chain", "tree"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-eager"])
def test_generate_rows_equal_oracle(arch, mode, padding):
    lengths, max_new = (1, 6, 11), 10
    spec = {"plain": None, "chain": CHAIN, "tree": TREE}[mode]
    eng = engine(arch, None if spec is None else "perturbed", spec, padding)
    samples = eng.generate(prompts(lengths), SamplingSettings(max_new_tokens=max_new))
    reference = plain_greedy(arch, lengths, max_new)
    for sample, ref, (_, p) in zip(samples, reference, prompts(lengths)):
        assert torch.equal(sample.input_ids[: p.numel()], p)
        assert sample.input_ids.numel() - p.numel() == max_new
        assert sample.num_rows == sample.input_ids.numel() - 1  # completion rows == completion tokens
        assert torch.equal(sample.input_ids, ref.input_ids)  # speculation never changes greedy output
        assert sample.finish_reason == "length"
        check_oracle(target(arch), sample, eng.groups)
        if spec is None:
            assert sample.accept_lens is None
        else:
            check_trim(sample, spec.num_draft_tokens)


@pytest.mark.parametrize("regime", ["same", "random", "perturbed"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("lengths", [(1,), (3, 1, 8)], ids=["batch1", "batch3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_acceptance_regimes(arch, lengths, spec, regime):
    max_new = 16
    eng = engine(arch, regime, spec)
    samples = eng.generate(prompts(lengths), SamplingSettings(max_new_tokens=max_new))
    for sample, ref in zip(samples, plain_greedy(arch, lengths, max_new)):
        assert torch.equal(sample.input_ids, ref.input_ids)
        check_oracle(target(arch), sample, eng.groups)
        check_trim(sample, spec.num_draft_tokens)
    a = torch.cat([s.accept_lens for s in samples]).long()
    if regime == "same" and spec.topk == 1:
        assert bool((a == spec.num_draft_tokens).all()), a  # the target's own chain: everything accepted
    elif regime == "same":
        # the draft's best child is always kept and always right; deeper nodes compete on score
        assert bool((a >= 2).all()), a
    elif regime == "random":
        assert float((a == 1).float().mean()) >= 0.8, a
    else:
        assert bool((a == 1).any()) and bool((a > 1).any()), a


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drafts_do_not_depend_on_batch_neighbours(arch, spec):
    # rows that accept less than their neighbours leave padding in both caches; a request's drafts
    # (hence its accept lengths) must be the same alone as in a batch, left or right padded
    lengths = (5, 1, 9)
    reqs = prompts(lengths)
    sampling = SamplingSettings(max_new_tokens=16)
    alone = [engine(arch, "perturbed", spec).generate([r], sampling)[0] for r in reqs]
    for padding in ("right", "left"):
        batched = engine(arch, "perturbed", spec, padding).generate(reqs, sampling)
        for a, b in zip(alone, batched):
            assert torch.equal(a.input_ids, b.input_ids)
            assert a.accept_lens.tolist() == b.accept_lens.tolist()
    assert len({tuple(s.accept_lens.tolist()) for s in alone}) > 1  # the requests did accept differently


def test_overshoot_at_max_new_tokens_is_trimmed():
    arch, lengths = "llama", (2, 5, 1)
    eng = engine(arch, "same", CHAIN)
    samples = eng.generate(prompts(lengths), SamplingSettings(max_new_tokens=7))
    reference = plain_greedy(arch, lengths, 16)
    for sample, ref in zip(samples, reference):
        # first token from the prefill, then steps of 4: 1 + 4 + 4 = 9 emitted, 7 kept
        assert sample.accept_lens.tolist() == [4, 4]
        assert sample.input_ids.numel() - sample.prompt_len == 7
        assert torch.equal(sample.input_ids, ref.input_ids[: sample.input_ids.numel()])
        assert sample.num_rows == sample.input_ids.numel() - 1
        assert sample.finish_reason == "length"
        check_oracle(target(arch), sample, eng.groups)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stop_token_mid_step_is_trimmed(arch):
    lengths, max_new, stride = (4, 1, 7), 16, CHAIN.num_draft_tokens
    reference = plain_greedy(arch, lengths, max_new)
    completion = reference[0].input_ids[lengths[0]:].tolist()
    # a token of request 0 that first appears strictly inside a verify step (completion index i:
    # index 0 comes from the prefill, steps emit indices 1-4, 5-8, ...; i % 4 == 0 ends a step)
    i = next(i for i in range(1, max_new) if i % stride != 0 and completion[i] not in completion[:i])
    stop = completion[i]
    eng = engine(arch, "same", CHAIN)
    samples = eng.generate(prompts(lengths), SamplingSettings(max_new_tokens=max_new, stop_token_ids=(stop,)))
    assert samples[0].input_ids.numel() - lengths[0] == i + 1
    assert int(samples[0].accept_lens.sum()) > i  # the step emitted past the stop token
    for sample, ref, p in zip(samples, reference, lengths):
        full = ref.input_ids[p:].tolist()
        expect = full.index(stop) + 1 if stop in full else max_new
        assert sample.input_ids.numel() - p == expect
        assert sample.finish_reason == ("stop" if stop in full else "length")
        assert torch.equal(sample.input_ids, ref.input_ids[: p + expect])
        assert sample.num_rows == p + expect - 1
        check_oracle(target(arch), sample, eng.groups)
        check_trim(sample, stride)


@pytest.mark.parametrize("regime", [None, "same"])
def test_stop_on_first_token(regime):
    arch, lengths = "qwen2", (3, 6)
    first = plain_greedy(arch, lengths, 16)[0].input_ids[3].item()
    eng = engine(arch, regime, CHAIN)
    samples = eng.generate(prompts(lengths), SamplingSettings(max_new_tokens=16, stop_token_ids=(first,)))
    assert samples[0].input_ids.numel() == 4 and samples[0].finish_reason == "stop"
    assert samples[0].num_rows == 3  # the prompt block alone
    if regime is not None:
        assert samples[0].accept_lens.numel() == 0
    for sample in samples:
        check_oracle(target(arch), sample, eng.groups)


@pytest.mark.parametrize("regime", [None, "same"])
def test_one_new_token_has_no_decode_steps(regime):
    eng = engine("llama", regime, TREE)
    samples = eng.generate(prompts((1, 4)), SamplingSettings(max_new_tokens=1))
    for sample, p in zip(samples, (1, 4)):
        assert sample.input_ids.numel() == p + 1 and sample.num_rows == p and sample.finish_reason == "length"
        assert sample.accept_lens is None if regime is None else sample.accept_lens.numel() == 0
        check_oracle(target("llama"), sample, eng.groups)


# ---- prefill mode ----------------------------------------------------------------------------

@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_equals_plain_forward(arch, padding):
    eng = engine(arch, padding=padding)
    reqs = prompts((9, 1, 4, 13), seed=3)
    samples = eng.prefill(reqs)
    for sample, (_, ids) in zip(samples, reqs):
        assert torch.equal(sample.input_ids, ids)
        assert sample.prompt_len == ids.numel() and sample.finish_reason == "prefill"
        check_oracle(target(arch), sample, eng.groups, teacher_forced=True)


def test_store_dtype_bfloat16():
    model = target("llama")
    eng = HFEngine(model, groups_for(model))  # default store dtype
    (sample,) = eng.prefill(prompts((5,)))
    assert all(h.dtype == torch.bfloat16 for h in sample.hidden.values())
    ref = oracle_rows(model, sample.input_ids, eng.groups)["final"].to(torch.bfloat16)
    assert torch.equal(sample.hidden["final"], ref)


# ---- sampling --------------------------------------------------------------------------------

@pytest.mark.parametrize("regime", [None, "perturbed"])
def test_sampled_decoding_is_reproducible(regime):
    arch, lengths = "llama", (2, 7, 1)
    eng = engine(arch, regime, TREE)

    def run(seed):
        return eng.generate(prompts(lengths), SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=seed))

    first, again, other = run(7), run(7), run(8)
    for a, b in zip(first, again):
        assert torch.equal(a.input_ids, b.input_ids)
        for name in a.hidden:
            assert torch.equal(a.hidden[name], b.hidden[name])
        check_oracle(target(arch), a, eng.groups)
    assert any(not torch.equal(a.input_ids, c.input_ids) for a, c in zip(first, other))
    greedy = plain_greedy(arch, lengths, 12)
    assert any(not torch.equal(a.input_ids, g.input_ids) for a, g in zip(first, greedy))


# ---- loading, demo models, errors ------------------------------------------------------------

def test_load_hf_engine_from_disk(tmp_path):
    model = target("qwen2")
    model.save_pretrained(tmp_path / "target")
    make_layerskip_draft(model, 2).save_pretrained(tmp_path / "draft")
    eng = load_hf_engine(str(tmp_path / "target"), "final,4", draft_path=str(tmp_path / "draft"),
                         spec=CHAIN, dtype=torch.float32, store_dtype=torch.float32)
    assert eng.shape == ModelShape(NUM_LAYERS, HIDDEN, 1)
    samples = eng.generate(prompts((3, 5)), SamplingSettings(max_new_tokens=6))
    for sample, ref in zip(samples, plain_greedy("qwen2", (3, 5), 6)):
        assert torch.equal(sample.input_ids, ref.input_ids)
        check_oracle(model, sample, eng.groups)


def test_demo_models_are_deterministic_and_layerskip_shares_the_prefix():
    a, b, c = build_tiny_llama(4, 64, 256, seed=0), build_tiny_llama(4, 64, 256, seed=0), build_tiny_llama(4, 64, 256, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    skip = make_layerskip_draft(a, 2)
    assert skip.config.num_hidden_layers == 2 and a.config.num_hidden_layers == 4
    ids = torch.arange(6)[None]
    with torch.no_grad():
        full, short = a(ids, output_hidden_states=True), skip(ids, output_hidden_states=True)
    assert torch.equal(full.hidden_states[1], short.hidden_states[1])  # same embeddings and block 0
    assert torch.equal(skip.lm_head.weight, a.lm_head.weight) and torch.equal(skip.model.norm.weight, a.model.norm.weight)
    moved = perturbed_copy(a, 0.1, seed=0)
    rel = (moved.lm_head.weight - a.lm_head.weight).pow(2).mean().sqrt() / a.lm_head.weight.pow(2).mean().sqrt()
    assert 0.05 < float(rel.detach()) < 0.2


def test_request_and_setting_errors():
    eng = engine("llama")
    with pytest.raises(HsxError, match="repeat"):
        eng.generate([("a", torch.tensor([1])), ("a", torch.tensor([2]))], SamplingSettings())
    with pytest.raises(HsxError, match="empty prompt"):
        eng.prefill([("a", torch.tensor([], dtype=torch.long))])
    with pytest.raises(HsxError, match="outside"):
        eng.prefill([("a", torch.tensor([VOCAB]))])
    with pytest.raises(HsxError, match="exceeds"):
        SpecSettings(num_steps=2, topk=1, num_draft_tokens=4)
    with pytest.raises(HsxError, match="without a draft"):
        HFEngine(target("llama"), groups_for(target("llama")), spec=CHAIN)
    with pytest.raises(HsxError, match="max_new_tokens"):
        SamplingSettings(max_new_tokens=0)
    with pytest.raises(HsxError, match="vocab"):
        HFEngine(target("llama"), groups_for(target("llama")), draft_model=build_tiny_llama(2, 64, 128))


def test_older_transformers_is_refused_by_name(monkeypatch):
    import transformers

    model = build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=64)
    groups = parse_layers("final", ModelShape.from_config(model.config))
    monkeypatch.setattr(transformers, "__version__", "5.19.0")
    with pytest.raises(HsxError, match=r"transformers >= 5\.24, found 5\.19\.0"):
        HFEngine(model, groups)
