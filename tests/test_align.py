"""The alignment core on hand-made tensors: layer-id rules, widths, stride slicing, trimming."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hsx.align import Collector, ModelShape, parse_layers, slice_verify_step, teacher_forced
from hsx.align.layers import eagle3_boundaries_from_ids, eagle3_default_boundaries, needed_sources
from hsx.errors import AlignmentError, HsxError

W = 4


def test_eagle3_default_is_sglangs_inputs_of_blocks_2_half_and_l_minus_3():
    assert eagle3_default_boundaries(32) == (2, 16, 29)
    groups = parse_layers("eagle3", ModelShape(32, 4096))
    assert groups[0].sources == (2, 16, 29) and groups[0].width == 3 * 4096 and groups[0].raw_ids is None


@pytest.mark.parametrize("ids,layers,boundaries,rule", [
    ([1, 15, 28], 32, (2, 16, 29), "+1"),  # draft configs name layer outputs
    ([0, 5, 10], 12, (1, 6, 11), "+1"),
    ([1, 12, 24], 24, (1, 12, 24), "as-is"),  # max id == L: already boundaries (GPT-OSS rule)
])
def test_draft_config_ids_map_to_boundaries(ids, layers, boundaries, rule):
    got, why = eagle3_boundaries_from_ids(ids, layers)
    assert got == boundaries and why.startswith(rule)
    group = parse_layers("final,eagle3", ModelShape(layers, 8), eagle3_ids=ids)[1]
    assert group.sources == boundaries and group.raw_ids == tuple(ids) and group.rule.startswith(rule)


def test_parse_layers_names_widths_and_needed_sources():
    groups = parse_layers("final, 0 ,b8,eagle3", ModelShape(8, 16))
    assert [g.name for g in groups] == ["final", "b0", "b8", "eagle3"]
    assert [g.width for g in groups] == [16, 16, 16, 48]
    assert needed_sources(groups) == [0, 2, 4, 5, 8, "final"]


@pytest.mark.parametrize("spec,match", [
    ("", "empty"), ("final,fianl", "fianl"), ("9", "outside 0..8"), ("b-1", "not 'final'"), ("final,final", "twice"),
])
def test_parse_layers_rejects_bad_items(spec, match):
    with pytest.raises(HsxError, match=match):
        parse_layers(spec, ModelShape(8, 16))


def test_eagle3_needs_three_ids():
    with pytest.raises(HsxError, match="3 aux layer ids"):
        parse_layers("eagle3", ModelShape(8, 16), eagle3_ids=[1, 2])


def test_hc_mult_widens_every_boundary_final_stays_one_stream_and_a_wrong_tensor_is_refused():
    config = SimpleNamespace(num_hidden_layers=4, hidden_size=8, hc_mult=4)
    shape = ModelShape.from_config(config)
    assert shape.unit_width == 32
    groups = parse_layers("final,eagle3,b4", shape)
    # boundaries are all 4 streams; final is lm_head's input, the streams collapsed: hidden_size wide
    assert [g.width for g in groups] == [8, 96, 32]
    assert "collapsed" in groups[0].rule
    assert shape.spans(("final", 4, 0)) == [(0, 8), (8, 40), (40, 72)]
    nested = SimpleNamespace(text_config=config)  # multimodal configs keep the LM under text_config
    assert ModelShape.from_config(nested) == shape
    c = Collector(groups[2:], torch.float32)
    with pytest.raises(AlignmentError, match=r"expected \[rows, 32\].*never reshaped"):
        c.prefill("r", torch.arange(3), {"b4": torch.zeros(3, 8)}, 7)  # hidden_size wide, not hc_mult x
    with pytest.raises(AlignmentError, match="never reshaped"):
        c.prefill("r", torch.arange(3), {"b4": torch.zeros(12, 8).view(3, 32)[:, :8]}, 7)
    c = Collector(groups[:1], torch.float32)
    with pytest.raises(AlignmentError, match=r"expected \[rows, 8\]"):
        c.prefill("r", torch.arange(3), {"final": torch.zeros(3, 32)}, 7)  # all streams where one is expected


def _step(token_ids: torch.Tensor) -> torch.Tensor:
    """Rows that carry their own token id in every column, so slicing mistakes are visible."""
    return token_ids.float().reshape(-1, 1).expand(-1, W).contiguous()


def test_slice_verify_step_takes_the_front_of_each_stride():
    step = _step(torch.arange(12))  # batch 3, stride 4: request i owns rows 4i..4i+3
    parts = slice_verify_step(step, torch.tensor([2, 0, 4]), 4)
    assert [p[:, 0].tolist() for p in parts] == [[0.0, 1.0], [], [8.0, 9.0, 10.0, 11.0]]
    with pytest.raises(AlignmentError, match="expected batch 3 x stride 5"):
        slice_verify_step(step, torch.tensor([1, 1, 1]), 5)
    with pytest.raises(AlignmentError, match="outside 0..4"):
        slice_verify_step(step, torch.tensor([1, 5, 1]), 4)


def _groups():
    return parse_layers("final", ModelShape(2, W))


def test_collector_builds_rows_per_request_and_trims_overshoot():
    c = Collector(_groups(), torch.float32)
    prompts = {"a": torch.tensor([10, 11, 12]), "b": torch.tensor([20])}
    for rid, p in prompts.items():
        c.prefill(rid, p, {"final": _step(p)}, first_token=int(p[-1]) + 1)
    # step 1: a accepts 3 (2 drafts + bonus), b accepts 1. Row j of a request's stride is the state
    # after consuming that slot's input token; the emitted tokens follow each input by one.
    inputs = torch.tensor([[13, 14, 15, 99], [21, 98, 97, 96]])
    emitted = inputs + 1
    c.step(["a", "b"], {"final": _step(inputs)}, emitted, torch.tensor([3, 1]), 4)
    # step 2: only b is left in the batch and overshoots max_new_tokens
    c.step(["b"], {"final": _step(torch.tensor([22, 23, 24, 25]))}, torch.tensor([[23, 24, 25, 26]]), torch.tensor([4]), 4)
    a = c.finish("a", finished_len=3, finish_reason="length")  # 13, 14, 15 kept; 16 trimmed
    b = c.finish("b", finished_len=4, finish_reason="length")  # 21, 22, 23, 24 kept; 25, 26 trimmed
    assert a.input_ids.tolist() == [10, 11, 12, 13, 14, 15]
    assert b.input_ids.tolist() == [20, 21, 22, 23, 24]
    # row j is the state after consuming token j: here it carries token j's id, for positions 0..N-2
    for s in (a, b):
        assert s.hidden["final"][:, 0].tolist() == s.input_ids[:-1].float().tolist()
    assert a.accept_lens.tolist() == [3] and b.accept_lens.tolist() == [1, 4]


def test_collector_refuses_dropped_rows_and_partial_prompts():
    c = Collector(_groups(), torch.float32)
    with pytest.raises(AlignmentError, match="2 prompt rows for a 3-token prompt"):
        c.prefill("a", torch.tensor([1, 2, 3]), {"final": _step(torch.tensor([2, 3]))}, 4)
    c.prefill("a", torch.tensor([1, 2, 3]), {"final": _step(torch.tensor([1, 2, 3]))}, 4)
    with pytest.raises(AlignmentError, match="1 tokens produced, finished length 3"):
        c.finish("a", finished_len=3, finish_reason="length")  # two decode steps never arrived
    c.prefill("b", torch.tensor([4]), {"final": _step(torch.tensor([4]))}, 5)
    with pytest.raises(AlignmentError, match="2 rows of 'final' for 1 tokens"):
        c.extend("b", {"final": _step(torch.tensor([5, 6]))}, torch.tensor([6]))
    with pytest.raises(AlignmentError, match="never started"):
        c.finish("zzz", finished_len=1, finish_reason="length")
    with pytest.raises(AlignmentError, match="no prefill block"):
        c.extend("c", {"final": _step(torch.tensor([5]))}, torch.tensor([6]))


def test_teacher_forced_needs_one_row_per_token():
    ids = torch.tensor([1, 2, 3])
    s = teacher_forced(ids, {"final": _step(ids)}, _groups(), torch.bfloat16)
    assert s.num_rows == 3 and s.hidden["final"].dtype == torch.bfloat16
    with pytest.raises(AlignmentError, match="2 rows of 'final' for 3 tokens"):
        teacher_forced(ids, {"final": _step(ids[:2])}, _groups(), torch.float32)
