"""The real-SGLang CPU lane's kernels against SGLang's own Triton kernels (run by Triton's interpreter).

Runs inside the lane only: ``bash scripts/sglang_cpu.sh python -m pytest -m sglang tests/test_sglang_lane.py``.
Each pure-torch op in ``scripts/sglang_cpu/cpu_lane/kernels.py`` replaces the CPU branch of an SGLang
function whose GPU branch launches a Triton kernel; here both run on the same random inputs and must
write the same values. The whole-engine check is the grid (``scripts/sglang_cpu_check.sh``).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytestmark = pytest.mark.sglang

if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
    pytest.skip("runs inside the real-SGLang CPU lane: bash scripts/sglang_cpu.sh python -m pytest -m sglang",
                allow_module_level=True)

# SGLang's Triton kernels run here through Triton's interpreter. Its kernels call Triton's own jit'd
# library functions (tl.sum, ...), which are interpreted only when the whole process is: set before
# SGLang's modules are imported (decoration time).
os.environ["TRITON_INTERPRET"] = "1"
kernels = importlib.import_module("cpu_lane.kernels")
stubs = importlib.import_module("cpu_lane.stubs")


def interpreted(module: str, name: str):
    from triton.runtime.interpreter import InterpretedFunction

    kernel = getattr(importlib.import_module(module), name)
    assert isinstance(kernel, InterpretedFunction), f"{module}.{name} was imported before TRITON_INTERPRET=1 was set"
    return kernel


def random_ranges(bs: int, gen, max_len: int = 40):
    start = torch.randint(0, 20, (bs,), generator=gen)
    end = start + torch.randint(0, max_len, (bs,), generator=gen)
    return start, end


@pytest.mark.parametrize("bs", [1, 3, 7])
def test_assign_req_to_token_pool(bs):
    gen = torch.Generator().manual_seed(bs)
    start, end = random_ranges(bs, gen)
    pools = torch.randperm(16, generator=gen)[:bs]
    locs = torch.randint(0, 10_000, (int((end - start).sum()),), generator=gen)
    mine, ref = (torch.full((16, 128), -1, dtype=torch.int32) for _ in range(2))
    kernels.assign_req_to_token_pool_cpu(pools, mine, start, end, locs, 128)
    interpreted("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool")[(bs,)](
        pools, ref, start, end, locs, 128, 8)
    assert torch.equal(mine, ref) and (mine != -1).sum() == locs.numel()


@pytest.mark.parametrize("bs", [1, 4, 9])
def test_assign_extend_cache_locs(bs):
    gen = torch.Generator().manual_seed(10 + bs)
    start, end = random_ranges(bs, gen)
    pools = torch.randperm(16, generator=gen)[:bs]
    table = torch.randint(0, 10_000, (16, 128), generator=gen, dtype=torch.int64)
    total = int((end - start).sum())
    mine, ref = torch.full((total + 5,), -1), torch.full((total + 5,), -1)
    kernels.assign_extend_cache_locs_cpu(pools, table, start, end, mine, 128)
    interpreted("sglang.kernels.ops.speculative.cache_locs", "assign_extend_cache_locs")[(bs,)](
        pools, table, start, end, ref, 128, 16)
    assert torch.equal(mine, ref) and bool((mine[:total] != -1).all())


@pytest.mark.parametrize("bs,topk,cols", [(1, 1, 3), (3, 2, 3), (5, 4, 2)])
def test_assign_draft_cache_locs_contiguous(bs, topk, cols):
    gen = torch.Generator().manual_seed(bs * topk)
    seq_lens = torch.randint(1, 60, (bs,), generator=gen)
    pools = torch.randperm(16, generator=gen)[:bs]
    table = torch.randint(0, 10_000, (16, 128), generator=gen, dtype=torch.int64)
    mine, ref = torch.full((bs * topk * cols,), -1), torch.full((bs * topk * cols,), -1)
    kernels.assign_draft_cache_locs_contiguous_cpu(pools, table, seq_lens, mine, 128, topk, cols)
    interpreted("sglang.kernels.ops.speculative.cache_locs", "assign_draft_cache_locs_contiguous")[(bs,)](
        pools, table, seq_lens, ref, 128, topk, cols, BS=bs)
    assert torch.equal(mine, ref)


@pytest.mark.parametrize("bs,stride", [(1, 4), (4, 6), (6, 8)])
def test_fill_accept_out_cache_loc_and_bonus_tokens(bs, stride):
    gen = torch.Generator().manual_seed(bs + stride)
    accept_lens = torch.randint(1, stride + 1, (bs,), generator=gen, dtype=torch.int32)
    index = torch.full((bs, stride), -1, dtype=torch.int32)
    for i, n in enumerate(accept_lens.tolist()):
        index[i, :n] = torch.randperm(stride, generator=gen)[:n] + i * stride
    out_cache_loc = torch.randint(0, 10_000, (bs * stride,), generator=gen)
    size = index.numel()
    mine, ref = torch.full((size,), -7), torch.full((size,), -7)
    kernels.fill_accept_out_cache_loc_cpu(index, out_cache_loc, mine)
    from sglang.srt.utils import next_power_of_2

    interpreted("sglang.kernels.ops.speculative.eagle", "fill_accept_out_cache_loc")[(size,)](
        index, out_cache_loc, ref, next_power_of_2(size))
    assert torch.equal(mine, ref)

    tokens = torch.randint(0, 500, (bs, stride), generator=gen)
    mine_b, ref_b = torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    kernels.fill_bonus_tokens_cpu(tokens, accept_lens, mine_b, stride)
    interpreted("sglang.kernels.ops.speculative.eagle", "fill_bonus_tokens")[(bs,)](tokens, accept_lens, ref_b, stride)
    assert torch.equal(mine_b, ref_b) and torch.equal(mine_b, tokens[torch.arange(bs), accept_lens.long() - 1])


def test_copy_all_layer_kv_cache_refuses_a_real_move():
    same = torch.arange(5)
    kernels.copy_all_layer_kv_cache_cpu(None, None, same, same)
    with pytest.raises(RuntimeError, match="SGLANG_NATIVE_MOVE_KV_CACHE"):
        kernels.copy_all_layer_kv_cache_cpu(None, None, same, same.flip(0))


def test_sgl_kernel_stand_ins_are_loud_and_provided_ops_are_real():
    import sgl_kernel

    with pytest.raises(stubs.LaneStandInCalled, match="sgl_kernel.some_gpu_kernel"):
        sgl_kernel.some_gpu_kernel(torch.zeros(1))
    for op in kernels.OPS:
        assert getattr(sgl_kernel, op.__name__) is op


def test_standin_request_leaves_the_named_op_silent(monkeypatch):
    import sgl_kernel

    monkeypatch.setenv("HSX_LANE_STANDIN", "fill_bonus_tokens_cpu")
    stubs.provide(kernels.OPS)
    try:
        out = torch.zeros(2, dtype=torch.int64)
        sgl_kernel.fill_bonus_tokens_cpu(torch.ones(2, 4, dtype=torch.int64), torch.tensor([1, 2]), out, 4)
        assert out.tolist() == [0, 0]  # the silent stand-in wrote nothing
        monkeypatch.setenv("HSX_LANE_STANDIN", "no_such_op")
        with pytest.raises(ValueError, match="no_such_op"):
            stubs.provide(kernels.OPS)
    finally:
        monkeypatch.delenv("HSX_LANE_STANDIN")
        stubs.provide(kernels.OPS)
    assert sgl_kernel.fill_bonus_tokens_cpu is kernels.fill_bonus_tokens_cpu
