"""The host side of hsx's vLLM capture, without vLLM: steps placed tag by tag, assembly by position, the
packed form a multiprocess engine core sends, and (on a GPU) the asynchronous copy to host memory.

The capture inside a real vLLM runner is tested in the lane (tests/test_vllm_lane.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hsx.engine.vllm.capture import _by_tag, _Step, _ToHost, assemble, pack, unpack


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def step(owners: list[tuple[int, int, int]], width: int = 3, sources: int = 2, run: int = 0) -> _Step:
    """One step of requests ``(tag id, first position, rows)``; each sampled one token (7) after its last row.

    Row values: ``tag * 1000 + position * 10 + run`` at source 0, negated at source 1, across the width."""
    tags = np.concatenate([np.full(n, t) for t, _, n in owners]).astype(np.int64)
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in owners]).astype(np.int64)
    value = torch.from_numpy(tags * 1000 + pos * 10 + run).float()
    rows = torch.stack([value, -value])[:sources, :, None].expand(-1, -1, width).contiguous()  # [S, R, W]
    ends = np.cumsum([n for *_, n in owners])
    return _Step(tags, pos + 100, (rows, torch.from_numpy(pos)), np.array([t for t, *_ in owners], np.int64),
                 ends - 1, np.ones(len(owners), np.int64), np.full(len(owners), 7, np.int64))


def record(spans: list[tuple[int, int]]):
    """One request's record (tag 0) of ``(first position, rows)`` steps, placed by the capture's own code."""
    return _by_tag([step([(0, p, n)], sources=1, run=r) for r, (p, n) in enumerate(spans)], {0: "t"}, ["final"])["t"]


def test_assembly_keeps_the_latest_row_of_each_position():
    got = assemble(record([(0, 5), (5, 1), (6, 2), (0, 8), (8, 1)]))  # preempted after 8, recomputed 0..7
    assert got.recomputed == 8
    assert got.fed.tolist() == list(range(100, 109))
    assert got.rows["final"][:, 0].tolist() == [p * 10 + (3 if p < 8 else 4) for p in range(9)]
    assert [s for s, _ in got.steps] == [5, 6, 8, 9]
    assert got.sampled == {5: 7, 6: 7, 8: 7, 9: 7}


def test_assembly_names_a_missing_position():
    assert "miss positions [5]" in assemble(record([(0, 5), (6, 2)]))


def test_interleaved_requests_are_placed_tag_by_tag():
    """Three requests in varying order across steps; tag 9 is not asked for and is dropped."""
    steps = [step([(0, 0, 4), (1, 0, 2), (9, 0, 3)], run=0),
             step([(1, 2, 1), (0, 4, 1)], run=1),
             step([(9, 3, 1), (0, 5, 2), (1, 3, 3)], run=2)]
    got = _by_tag(steps, {0: "a", 1: "b"}, ["final", "b3"])
    assert sorted(got) == ["a", "b"]
    for tag, tid, length in (("a", 0, 7), ("b", 1, 6)):
        one = assemble(got[tag])
        assert one.recomputed == 0 and one.fed.tolist() == [100 + p for p in range(length)]
        value = one.rows["final"][:, 0]
        assert ((value - tid * 1000) // 10).tolist() == list(range(length))
        assert torch.equal(one.rows["b3"], -one.rows["final"])
        assert one.rows["final"].shape == (length, 3)
    assert assemble(got["a"]).steps == [(4, 1), (5, 1), (7, 1)]
    assert assemble(got["b"]).steps == [(2, 1), (3, 1), (6, 1)]


def test_a_request_without_reordering_keeps_views_of_the_block():
    rec = record([(0, 4), (4, 1), (5, 1)])
    got = assemble(rec)
    assert got.rows["final"].untyped_storage().data_ptr() == rec["rows"].untyped_storage().data_ptr()


def test_packed_records_come_back_equal_from_one_shared_file():
    steps = [step([(0, 0, 4), (1, 0, 2)]), step([(1, 2, 1), (0, 4, 1)], run=1)]
    records = _by_tag(steps, {0: "a", 1: "b"}, ["final", "b3"])
    packed = pack(records)
    files = {r["rows"]["file"] for r in packed.values()}
    assert len(files) == 1
    back = unpack(packed)
    assert not any(os.path.exists(f) for f in files)  # mapped, then removed
    assert back.keys() == records.keys()
    for tag, rec in records.items():
        assert back[tag].keys() == rec.keys()
        assert back[tag]["rows"].dtype == rec["rows"].dtype and torch.equal(back[tag]["rows"], rec["rows"])
        for k in ("positions", "fed", "first", "count", "tokens"):
            assert back[tag][k].dtype == rec[k].dtype and np.array_equal(back[tag][k], rec[k])
        assert assemble(back[tag]).rows["b3"].tolist() == assemble(rec).rows["b3"].tolist()
    assert pack({}) == {} and unpack({}) == {}


def test_on_cpu_the_gathered_rows_are_handed_over_as_they_are():
    rows, pos = torch.randn(2, 5, 3), torch.arange(5)
    got = _ToHost(torch.device("cpu"))(rows, pos)
    assert got[0] is rows and got[1] is pos


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, asynchronous copy needs a GPU")
def test_on_a_gpu_rows_arrive_equal_through_the_reused_pinned_buffers():
    to_host = _ToHost(torch.device("cuda"))
    sent, got = [], []
    for n in (3, 64, 5, 200, 1, 7):  # growing and shrinking: buffers reused, grown when too small
        rows = torch.randn(4, n, 96, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 1 << 40, (n,), device="cuda")
        sent.append((rows.cpu(), pos.cpu()))
        got.append(to_host(rows, pos))
        del rows, pos  # the copy must hold its source alive on the side stream
    for (rows, pos), future in zip(sent, got, strict=True):
        h_rows, h_pos = future.result()
        assert h_rows.device.type == "cpu" and not h_rows.is_pinned()
        assert torch.equal(h_rows, rows) and torch.equal(h_pos, pos)
