"""Scheduling: prefill batches by length and token budget; continuous batching in the transformers engine.

Continuous batching must not change what is stored: every request's tokens and accept lengths
equal those of the request run alone, and every row equals the oracle (a teacher-forced forward
of one sequence), whatever the slots, the admission budget and the finishing order were.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hsx.align import ModelShape, parse_layers
from hsx.demo.models import build_tiny_llama, build_tiny_qwen2, perturbed_copy
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings
from hsx.engine.hf.batching import longest_first, prefill_batches
from oracle import oracle_rows

VOCAB, TOL = 256, 1e-4
CHAIN = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
TREE = SpecSettings(num_steps=3, topk=4, num_draft_tokens=8)
LENGTHS = (1, 9, 4, 15, 2, 7, 11)
MAX_NEW = 12


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- prefill batches ---------------------------------------------------------------------------

def test_longest_first_keeps_ties_in_order():
    assert longest_first([3, 7, 3, 9, 7]) == [3, 1, 4, 0, 2]


def test_prefill_batches_respect_rows_and_tokens():
    lengths = [5, 40, 12, 33, 7, 40, 1, 20]
    batches = prefill_batches(lengths, max_rows=3, max_tokens=90)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each sequence once
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 90
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)
    assert batches[0] == [1, 5]  # 3 x 40 > 90: the longest pair alone
    assert prefill_batches(lengths, max_rows=8) == [longest_first(lengths)]
    assert prefill_batches([100, 3], max_rows=4, max_tokens=10) == [[0], [1]]  # too long alone still runs
    with pytest.raises(ValueError):
        prefill_batches(lengths, max_rows=0)


# ---- continuous batching -----------------------------------------------------------------------

@functools.cache
def target(arch: str):
    build = build_tiny_llama if arch == "llama" else build_tiny_qwen2
    return build(4, 64, VOCAB, seed=0)


@functools.cache
def draft(arch: str):
    return perturbed_copy(target(arch), scale=0.4, seed=1)


def make_engine(arch, spec):
    model = target(arch)
    groups = parse_layers("final,eagle3,0,2,4", ModelShape.from_config(model.config), eagle3_ids=[0, 2, 3])
    return HFEngine(model, groups, draft_model=None if spec is None else draft(arch), spec=spec,
                    store_dtype=torch.float32)


def requests():
    gen = torch.Generator().manual_seed(3)
    return [(f"r{i}", torch.randint(0, VOCAB, (n,), generator=gen)) for i, n in enumerate(LENGTHS)]


@functools.cache
def sampling(arch: str) -> SamplingSettings:
    """Stop tokens taken from the requests' own plain completions, so they finish at different steps."""
    plain = make_engine(arch, None).generate(requests(), SamplingSettings(max_new_tokens=MAX_NEW))
    stops = {int(plain[0].input_ids[plain[0].prompt_len + 3]), int(plain[3].input_ids[plain[3].prompt_len + 6])}
    return SamplingSettings(max_new_tokens=MAX_NEW, stop_token_ids=tuple(sorted(stops)))


@functools.cache
def alone(arch: str, mode: str):
    spec = {"plain": None, "chain": CHAIN, "tree": TREE}[mode]
    return {rid: make_engine(arch, spec).generate([(rid, ids)], sampling(arch))[0] for rid, ids in requests()}


@pytest.mark.parametrize("budget", [None, 12], ids=["no-budget", "budget12"])
@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize("mode", ["plain", "chain", "tree"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_continuous_batching_equals_each_request_alone(arch, mode, slots, budget):
    spec = {"plain": None, "chain": CHAIN, "tree": TREE}[mode]
    eng = make_engine(arch, spec)
    got = list(eng.stream(requests(), sampling(arch), slots=slots, max_prefill_tokens=budget))
    assert sorted(rid for rid, _ in got) == sorted(rid for rid, _ in requests())
    reasons = set()
    for rid, sample in got:
        ref = alone(arch, mode)[rid]
        assert torch.equal(sample.input_ids, ref.input_ids), rid
        assert sample.finish_reason == ref.finish_reason, rid
        reasons.add(sample.finish_reason)
        if spec is None:
            assert sample.accept_lens is None
        else:
            assert sample.accept_lens.tolist() == ref.accept_lens.tolist(), rid
        oracle = oracle_rows(target(arch), sample.input_ids, eng.groups)
        rows = sample.input_ids.numel() - 1
        for g in eng.groups:
            assert sample.hidden[g.name].shape == (rows, g.width)
            assert float((sample.hidden[g.name] - oracle[g.name][:rows]).abs().max()) <= TOL, (rid, g.name)
    assert reasons == {"stop", "length"}  # requests finished at different steps
    s = eng.stats
    assert s.admissions > 1 and s.waiting_steps > 0
    assert s.waiting_full == s.waiting_steps  # while requests waited, every row was busy
    assert s.row_steps <= s.steps * slots
    if budget is not None:  # an admission of several requests stays within the budget
        assert s.widest_admission <= budget
    elif slots > 1:
        assert s.widest_admission > 12  # (so the budget above did bind)


def test_results_come_back_as_requests_finish():
    eng = make_engine("llama", None)
    got = [rid for rid, _ in eng.stream(requests(), sampling("llama"), slots=3)]
    order = [rid for rid, _ in requests()]
    assert sorted(got) == sorted(order) and got != order  # an early stop overtook a request admitted before it


def test_stream_is_reproducible_when_sampling():
    eng = make_engine("llama", CHAIN)
    hot = SamplingSettings(max_new_tokens=MAX_NEW, temperature=1.0, seed=5)
    a = dict(eng.stream(requests(), hot, slots=3))
    b = dict(eng.stream(requests(), hot, slots=3))
    for rid in a:
        assert torch.equal(a[rid].input_ids, b[rid].input_ids)
        assert torch.equal(a[rid].hidden["final"], b[rid].hidden["final"])


def test_cache_storage_allocated_ahead_is_zero_not_garbage():
    # stale slots are masked, but a masked NaN (or a huge garbage score) still poisons the softmax:
    # storage handed out ahead of use must hold finite values
    from hsx.engine.hf.engine import _SlotLayer

    poison = torch.full((1 << 22,), float("nan"), dtype=torch.bfloat16)  # leave NaNs in freed memory
    del poison
    layer = _SlotLayer(capacity=64)
    k = torch.randn(3, 2, 5, 8, dtype=torch.bfloat16)
    keys, values = layer.update(k, k.clone())
    assert keys.shape == (3, 2, 5, 8) and torch.equal(keys, k)
    assert layer.k_buf.shape[2] == 64 and bool((layer.k_buf[:, :, 5:] == 0).all())
    layer.update(torch.randn(3, 2, 70, 8, dtype=torch.bfloat16), torch.randn(3, 2, 70, 8, dtype=torch.bfloat16))
    assert layer.width == 75 and layer.k_buf.shape[2] >= 75
    assert bool((layer.k_buf[:, :, 75:] == 0).all()) and bool((layer.v_buf[:, :, 75:] == 0).all())
