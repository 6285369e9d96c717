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



TRIPWIRE_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
import grid
from hsx.demo.spec_models import build_spec_models
models = build_spec_models(sys.argv[2])
runner = grid.start(models, None, 1, 1, "final", sys.argv[3])
samples = runner.run(grid.make_prompts(models, "mixed", [5, 9], 0, "tripwire"))
runner.engine.shutdown()
print("ROWS", sum(s.num_rows for s in samples))
"""


@pytest.mark.parametrize("capture", ["lists", "tensors"])
def test_list_tripwire(tmp_path, capture):
    """The grid's proof that the capture never takes SGLang's list path rests on the tripwire
    (HSX_LANE_FORBID_LISTS=1, set by grid.start for the capture): lists under it must fail in
    SGLang's scheduler, the capture under it must run. (SGLang ends its parent process when the
    scheduler fails, so the run is a subprocess.)"""
    import subprocess
    import sys
    from pathlib import Path

    lane = Path(__file__).resolve().parents[1] / "scripts" / "sglang_cpu"
    env = {**os.environ, "HSX_LANE_FORBID_LISTS_FOR_LISTS": "1"}
    proc = subprocess.run([sys.executable, "-c", TRIPWIRE_RUN, str(lane), str(tmp_path / "models"), capture],
                          capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    if capture == "lists":
        assert proc.returncode != 0 and "LaneListPathTaken" in out, out[-3000:]
    else:
        assert proc.returncode == 0 and "ROWS" in proc.stdout, out[-3000:]


# ---- one EAGLE3 head config on SGLang, the transformers engine and (converted) vLLM's format ----------------

CPU_ARGS = ["--device", "cpu", "--model-dtype", "float32", "--attention-backend", "torch_native",
            "--engine-arg", "sampling_backend=pytorch", "--engine-arg", "disable_cuda_graph=true",
            "--engine-arg", "mem_fraction_static=0.05", "--engine-arg", "max_total_tokens=16384",
            "--engine-arg", "context_length=1024", "--engine-arg", "sleep_on_idle=true"]
HEAD_RUN = ["--dtype", "float32", "--layers", "final,eagle3", "--max-new-tokens", "10", "--batch-size", "3",
            "--spec-num-steps", "3"]
WORDS = ["the cat sat on a mat", "speculative decoding", "hidden states are rows"]


def _hsx(python: str, args: list[str], env: dict) -> None:
    import subprocess

    done = subprocess.run([python, "-c", "from hsx.cli import main; main()", *args], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def test_one_head_config_names_the_same_boundaries_on_sglang_and_the_transformers_engine(tmp_path):
    """The demo's EAGLE3 head (ids [1, 3, 5], SGLang's rule: boundaries 2, 4, 6) and the same head converted by
    ``hsx export vllm-head`` (ids [2, 4, 6], marked "vllm"): on a real SGLang both give boundaries 2, 4, 6 (hsx
    hands SGLang a copy of the converted head whose config names SGLang's ids [1, 3, 5]), the same drafts
    (accept lengths) and the rows of the transformers engine's run of the SGLang head (within 1e-4).
    SGLang runs in subprocesses (it ends its parent when its scheduler fails); the transformers engine in
    hsx's own virtualenv ($HSX_VENV, default .venv: the lane's transformers is older than it needs)."""
    import json
    import sys
    from pathlib import Path

    import hsx
    from hsx.demo.spec_models import build_spec_models

    root = Path(__file__).resolve().parents[1]
    models = build_spec_models(tmp_path / "models")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": w * (i + 1)}) + "\n" for i, w in enumerate(WORDS)))
    lane_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as scripts/sglang_cpu.sh runs hsx
    converted = tmp_path / "vllm-eagle3"
    _hsx(sys.executable, ["export", "vllm-head", str(models.eagle3), str(converted), "--model", str(models.target)],
         lane_env)
    runs = {"sglang": models.eagle3, "sglang-vllm-head": converted}
    for name, head in runs.items():
        done = _hsx(sys.executable, ["extract", "--engine", "sglang", "--spec-algorithm", "EAGLE3", "--model",
                                     str(models.target), "--draft-model", str(head), "--dataset", str(data), "-o",
                                     str(tmp_path / name), *HEAD_RUN, *CPU_ARGS],
                    {**lane_env, "HSX_LANE_FORBID_LISTS": "1"})
        if name == "sglang-vllm-head":
            assert "hsx hands it a copy whose config names ids [1, 3, 5]" in done.stderr, done.stderr[-3000:]
    python = Path(os.environ.get("HSX_VENV", root / ".venv")) / "bin" / "python"
    assert python.exists(), f"{python}: hsx's virtualenv (bash scripts/setup.sh, or set HSX_VENV)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "VIRTUAL_ENV", "PYTHONPATH",
                                                                    "TRITON_", "HSX_LANE"))}
    _hsx(str(python), ["extract", "--engine", "hf", "--model", str(models.target), "--draft-model", str(models.eagle3),
                       "--dataset", str(data), "-o", str(tmp_path / "hf"), "--device", "cpu", "--model-dtype", "float32",
                       *HEAD_RUN], {**env, "PYTHONPATH": str(root)})

    outs = {name: hsx.open(str(tmp_path / name)) for name in ("hf", "sglang", "sglang-vllm-head")}
    for name, out in outs.items():
        eagle3 = next(g for g in out.metadata["layers"] if g["name"] == "eagle3")
        assert eagle3["sources"] == [2, 4, 6], name
        assert out.metadata["speculative"]["aux_layers"]["boundaries"] == [2, 4, 6], name
    aux = outs["sglang-vllm-head"].metadata["speculative"]["aux_layers"]
    assert (aux["aux_layer_ids_rule"], aux["head_ids"], aux["engine_ids"]) == ("vllm", [2, 4, 6], [1, 3, 5])
    assert outs["sglang"].metadata["speculative"]["aux_layers"]["rule_from"] == "engine default"
    ref = outs["hf"]
    for name in ("sglang", "sglang-vllm-head"):
        assert sorted(s.sample_id for s in outs[name]) == sorted(s.sample_id for s in ref), name
        for s in ref:
            t = outs[name][s.sample_id]
            assert t.input_ids.tolist() == s.input_ids.tolist(), (name, s.sample_id)
            for column in ("eagle3", "final"):
                x, y = s.hidden(column).float(), t.hidden(column).float()
                assert x.shape == y.shape and x.shape[0] > 0, (name, s.sample_id, column)
                err = float((x - y).abs().max() / x.abs().max())
                assert err < 1e-4, (name, s.sample_id, column, err)
    for s in outs["sglang"]:  # the converted head drafts as the original: the same accept lengths
        assert outs["sglang-vllm-head"][s.sample_id].accept_lens.tolist() == s.accept_lens.tolist(), s.sample_id


# ---- the 2026 families on SGLang: every stored row against a teacher-forced forward ----------------------------

# The families SGLang 0.5.23 runs on this CPU lane (docs/SGLANG.md lists the others and the error each gave), with
# the columns it can capture: boundaries through its aux capture where the model class has it, else final only.
# Boundary 0 is reachable only under DeepSeek's id rule (docs/MODELS.md).
SGLANG_FAMILIES = {
    "glm4_moe": "final,b1,b3",
}
FAMILY_ARGS = ["--device", "cpu", "--model-dtype", "float32", "--dtype", "float32", "--attention-backend",
               "torch_native", "--engine-arg", "sampling_backend=pytorch", "--engine-arg", "disable_cuda_graph=true",
               "--engine-arg", "mem_fraction_static=0.05", "--engine-arg", "max_total_tokens=16384", "--engine-arg",
               "context_length=512", "--engine-arg", "sleep_on_idle=true", "--batch-size", "3", "--id-field", "id"]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import lane_families

    root = tmp_path_factory.mktemp("sglang-families")
    return lane_families, {f: lane_families.build_in_hsx_venv(f, root / f, "sglang") for f in SGLANG_FAMILIES}


@pytest.mark.parametrize("mode", ["prefill", "generate"])
@pytest.mark.parametrize("family", sorted(SGLANG_FAMILIES))
def test_family_rows_equal_a_teacher_forced_forward(family, mode, family_models, tmp_path):
    """``hsx extract --engine sglang`` on the family's tiny model (tests/families.py, the demo tokenizer, three
    prompts of 4-31 tokens, 10 new tokens in generate mode); ``hsx verify --recompute`` in hsx's own virtualenv
    finds every row of every column equal to its teacher-forced forward, each completion token is that forward's
    argmax, and a copy with one sample's rows moved by one position is caught (tests/lane_families.py)."""
    import sys

    lane_families, models = family_models
    model, out = models[family], tmp_path / "out"
    lane_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = ["--mode", mode] + (["--max-new-tokens", "10"] if mode == "generate" else [])
    _hsx(sys.executable, ["extract", "--engine", "sglang", "--model", str(model), "--dataset",
                          str(model / "data.jsonl"), "-o", str(out), "--layers", SGLANG_FAMILIES[family], "--quiet",
                          *run, *FAMILY_ARGS], {**lane_env, "HSX_LANE_FORBID_LISTS": "1"})
    report = lane_families.check_in_hsx_venv(out, mode)
    print(f"[sglang {family} {mode}] {report['rows']} rows x {len(report['columns'])} columns, worst "
          f"{report['worst']:.2g} of the largest reference value, {report['greedy_tokens']} greedy tokens")
