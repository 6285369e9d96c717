"""hsx's vLLM engine on a real vLLM 0.32, against the transformers engine and the oracle.

Runs inside the vLLM CPU lane only: ``bash scripts/vllm_cpu.sh python -m pytest -m vllm
tests/test_vllm_lane.py``; skipped where ``vllm`` is not importable. Each engine start costs 15-30 s
here, so the tests share a few engines; the whole grid is ``scripts/vllm_cpu_check.sh``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("vllm", reason="runs inside the vLLM CPU lane: bash scripts/vllm_cpu.sh python -m pytest -m vllm")

from typer.testing import CliRunner  # noqa: E402

from hsx.align import AlignedSample  # noqa: E402
from hsx.cli import app  # noqa: E402
from hsx.config import ExtractConfig  # noqa: E402
from hsx.data.render import Prompt  # noqa: E402
from hsx.demo.spec_models import build_spec_models  # noqa: E402
from hsx.engine.vllm.capture import check_version  # noqa: E402
from hsx.errors import HsxError  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts" / "vllm_cpu"))
from heads import vllm_heads  # noqa: E402
from oracle import oracle_rows, oracle_sources  # noqa: E402

MAX_NEW = 10


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_spec_models(tmp_path_factory.mktemp("vllm-models"))


def prompts(models, lengths=(3, 21, 70), regime="mixed", seed=0) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(sum(models.classes.values(), []))
    out = []
    for i, n in enumerate(lengths):
        ids = pool[torch.randint(len(pool), (n,), generator=g)]
        ids[-1] = models.classes[regime][i % len(models.classes[regime])]
        out.append(Prompt(f"s{i}", i, ids.tolist(), [1] * n))
    return out


def config(models, engine, **kw) -> ExtractConfig:
    base = dict(model=str(models.target), engine=engine, device="cpu", model_dtype="float32", dtype="float32",
                max_new_tokens=MAX_NEW, layers="final")
    return ExtractConfig(**{**base, **kw})


def transformers_engine(models, batch, layers: str, tmp_path) -> dict:
    """The transformers engine's samples, from hsx's own virtualenv (the lane's transformers is too old for it)."""
    from safetensors.torch import load_file

    python = Path(os.environ.get("HSX_VENV", ROOT / ".venv")) / "bin" / "python"
    assert python.exists(), f"{python}: hsx's virtualenv (bash scripts/setup.sh, or set HSX_VENV)"
    ids, out = tmp_path / "prompts.json", tmp_path / "hf.safetensors"
    ids.write_text(json.dumps([p.input_ids for p in batch]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VIRTUAL_ENV", "PYTHONPATH"))}
    done = subprocess.run([str(python), str(ROOT / "scripts" / "vllm_cpu" / "hf_reference.py"), str(models.target),
                           str(ids), layers, str(MAX_NEW), str(out)], env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(out))


def test_greedy_tokens_and_rows_equal_the_transformers_engine(models, tmp_path):
    from hsx.engine.vllm.runner import VLLMRunner

    batch = prompts(models)
    theirs = transformers_engine(models, batch, "final,b3", tmp_path)
    runner = VLLMRunner(config(models, "vllm", layers="final,b3"))
    mine = runner.run(batch)
    oracle = None
    for i, (p, a) in enumerate(zip(batch, mine, strict=True)):
        assert isinstance(a, AlignedSample), a
        assert a.input_ids.tolist() == theirs[f"ids.{i}"].tolist(), p.sample_id
        for name in ("final", "b3"):
            b = theirs[f"{name}.{i}"]
            assert a.hidden[name].shape == b.shape
            assert float((a.hidden[name] - b).abs().max()) < 1e-4
        if oracle is None:
            from transformers import AutoModelForCausalLM

            oracle = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
        want = oracle_rows(oracle, a.input_ids, runner.groups)
        for g in runner.groups:
            ref = want[g.name][: a.hidden[g.name].shape[0]]
            assert float((a.hidden[g.name] - ref).abs().max() / ref.abs().max()) < 1e-4


def test_extract_then_verify_recompute_passes(models, tmp_path):
    data = tmp_path / "data.jsonl"
    words = ["the cat sat on a mat", "speculative decoding", "hidden states are rows", "a b c d e f g"]
    data.write_text("".join(json.dumps({"text": w * (i + 1)}) + "\n" for i, w in enumerate(words)))
    _, eagle3 = vllm_heads(models)
    out = tmp_path / "out"
    run = CliRunner().invoke(app, [
        "extract", "--model", str(models.target), "--dataset", str(data), "-o", str(out), "--engine", "vllm",
        "--device", "cpu", "--model-dtype", "float32", "--dtype", "float32", "--layers", "final,eagle3",
        "--max-new-tokens", str(MAX_NEW), "--spec-algorithm", "EAGLE3", "--draft-model", str(eagle3),
        "--spec-num-steps", "3", "--batch-size", "3", "--quiet"])
    assert run.exit_code == 0, run.output
    check = CliRunner().invoke(app, ["verify", str(out), "--recompute", "--device", "cpu", "--model-dtype",
                                     "float32", "--json"])
    assert check.exit_code == 0, check.output
    r = json.loads(check.output)["recompute"]
    assert r["ok"] and len(r["samples"]) == len(words) and all(s["verdict"] == "ok" for s in r["samples"])
    assert r["row_checks"] == r["rows"] * (1 + 3) > 0  # final, eagle3 (3 sources)
    import hsx

    shards = hsx.open(str(out))
    meta = shards.metadata
    assert meta["engine"]["name"] == "vllm" and meta["speculative"]["algorithm"] == "EAGLE3"
    eagle3_group = next(g for g in meta["layers"] if g["name"] == "eagle3")
    assert eagle3_group["sources"] == [2, 4, 6]  # vLLM ids [2, 4, 6] of the rewritten head: boundary = id


@pytest.mark.parametrize("kw,match", [
    ({"spec_algorithm": "EAGLE", "layers": "final,b2"}, "EAGLE draft reads the final state"),
    ({"spec_algorithm": "EAGLE3", "layers": "final,b1"}, "under EAGLE3 vLLM captures boundaries"),
    ({"spec_algorithm": "EAGLE3", "spec_topk": 2}, "verifies chains only"),
    ({"spec_algorithm": "NGRAM", "spec_num_draft_tokens": 6}, "verifies chains only"),
    ({"spec_algorithm": "DFLASH"}, "hsx supports EAGLE, EAGLE3, NGRAM"),
    ({"prefill_chunk": 16}, "--prefill-chunk 16 applies to --engine hf"),
    ({"layers": "final,b2", "engine_args": {"enforce_eager": False}}, "enforce_eager=False"),
    ({"engine_args": {"enable_prefix_caching": True}}, "conflict with what hsx needs"),
])
def test_refusals_name_the_option(models, kw, match):
    from hsx.engine.vllm.runner import VLLMRunner

    _, eagle3 = vllm_heads(models)
    if kw.get("spec_algorithm") in ("EAGLE", "EAGLE3"):
        kw = {**kw, "draft_model": str(eagle3)}
    with pytest.raises(HsxError, match=match):
        VLLMRunner(config(models, "vllm", **kw))


def test_the_version_gate():
    check_version("0.32.0")
    check_version("0.32.3+cpu")
    for other in ("0.31.9", "0.33.0", "1.0.0", "unknown"):
        with pytest.raises(HsxError, match="0.32"):
            check_version(other)


def test_a_vision_language_target_is_refused_by_vllm_and_by_hsx(tmp_path, capfd):
    """vLLM 0.32's Qwen2.5-VL module imports transformers' torchvision image processor, and the lane has no
    torchvision (PyPI's wheel is a CUDA build that does not import beside the CPU torch), so vLLM refuses the
    model while inspecting its architecture, before any weight loads; hsx's runner refuses it itself, in one
    line (docs/VLLM.md, "Vision-language targets")."""
    import importlib.util

    from vllm import LLM

    from hsx.engine.vllm.runner import VLLMRunner

    sys.path.insert(0, str(ROOT / "tests"))
    from vl_models import build_vl

    assert importlib.util.find_spec("torchvision") is None, "the lane has torchvision: re-check docs/VLLM.md"
    model = build_vl("qwen2_5_vl", tmp_path / "qwen2_5_vl")
    with pytest.raises(ValueError, match=r"\['Qwen2_5_VLForConditionalGeneration'\] failed to be inspected"):
        LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512)
    out, err = capfd.readouterr()
    assert "No module named 'torchvision'" in out + err
    with pytest.raises(HsxError, match="qwen2_5_vl.*does not run vision-language targets in hsx: use --engine hf"):
        VLLMRunner(ExtractConfig(model=str(model), engine="vllm", device="cpu", model_dtype="float32"))


def test_multiprocess_engine_core_returns_the_same_rows(models, monkeypatch):
    """The engine core in its own process (vLLM's default): the capture is reached through collective_rpc."""
    from hsx.engine.vllm.runner import VLLMRunner

    batch = prompts(models, lengths=(5, 40))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    mine = VLLMRunner(config(models, "vllm", layers="final,b0,b8")).run(batch)
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(models.target, dtype=torch.float32).eval()
    for p, s in zip(batch, mine, strict=True):
        assert isinstance(s, AlignedSample), s
        assert s.input_ids[: len(p.input_ids)].tolist() == p.input_ids
        src = oracle_sources(oracle, s.input_ids)
        for name, source in (("final", "final"), ("b0", 0), ("b8", 8)):
            ref = src[source][: s.hidden[name].shape[0]]
            assert s.hidden[name].shape[0] == s.input_ids.numel() - 1
            assert float((s.hidden[name] - ref).abs().max() / ref.abs().max()) < 1e-4


# tensor operations that move a tensor's values into another tensor: what a copy to host memory is made of
COPIES = {"clone", "_to_copy", "copy_", "index_select", "index", "cat", "stack", "contiguous", "gather"}


class StepWork(TorchDispatchMode):
    """Counts the tensor operations hsx's capture runs in each engine step, vLLM's own sampling left out."""

    def __init__(self, model_runner):
        super().__init__()
        self.steps: list[Counter] = []
        self.paused = False
        capture = model_runner.sample_tokens
        inner = capture.inner

        def sampling_uncounted(grammar_output):
            self.paused = True
            try:
                return inner(grammar_output)
            finally:
                self.paused = False

        step = type(capture).__call__

        def counted_step(capture_self, grammar_output):
            self.steps.append(Counter())
            with self:
                return step(capture_self, grammar_output)

        capture.inner = sampling_uncounted
        # the capture stays the runner's sample_tokens (its take looks for it there), counted through a subclass
        capture.__class__ = type("CountedCapture", (type(capture),), {"__call__": counted_step})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.steps[-1][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model_runner(worker):
    return worker.model_runner


def test_capture_work_per_step_does_not_grow_with_the_batch(models):
    """Batches of 1, 8 and 64 tagged requests (prompts of 4-60 tokens, 4 new tokens, 4 sources): the most
    tensor operations, and the most copies, the capture runs in one step are the same at every batch size."""
    from hsx.engine.vllm.runner import VLLMRunner

    runner = VLLMRunner(config(models, "vllm", layers="final,b2,b4,b6", max_new_tokens=4))
    work = StepWork(runner.llm.collective_rpc(_model_runner)[0])
    most, copies = {}, {}
    for size in (1, 8, 64):
        work.steps.clear()
        batch = prompts(models, lengths=[4 + (7 * i) % 57 for i in range(size)], seed=size)
        for s in runner.run(batch):
            assert isinstance(s, AlignedSample), s
        counted = [c for c in work.steps if c]
        assert len(counted) >= 4, f"batch {size}: {len(counted)} steps"
        most[size] = max(sum(c.values()) for c in counted)
        copies[size] = max(sum(n for op, n in c.items() if op in COPIES) for c in counted)
    print(f"[capture] most tensor operations in a step by batch size {most}, of them copies {copies}")
    assert copies[1] > 0
    assert most[8] <= most[1] and most[64] <= most[1], most
    assert copies[8] <= copies[1] and copies[64] <= copies[1], copies


# ---- the 2026 families on vLLM: every stored row against a teacher-forced forward ------------------------------

# The families vLLM 0.32 runs on this CPU lane (docs/MODELS.md lists the others and the error each gave): the
# columns it can capture (boundaries where the model class has vLLM's EAGLE3 interface, else final only) and the
# recompute's relative limit (None: its float32 default). DeepSeek-V3's MLA rows on vLLM drift with depth to
# 2.1e-5 of the largest reference value (one final row measured 2.06e-5 against the default 2.01e-5).
VLLM_FAMILIES = {
    "glm4_moe": ("final", None),
    "falcon_h1": ("final", None),
    "gemma4": ("final,b1,b3", None),
    "deepseek_v3": ("final,b1,b3", 5e-5),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    import lane_families

    root = tmp_path_factory.mktemp("vllm-families")
    return lane_families, {f: lane_families.build_in_hsx_venv(f, root / f, "vllm") for f in VLLM_FAMILIES}


@pytest.mark.parametrize("mode", ["prefill", "generate"])
@pytest.mark.parametrize("family", sorted(VLLM_FAMILIES))
def test_family_rows_equal_a_teacher_forced_forward(family, mode, family_models, tmp_path):
    """``hsx extract --engine vllm`` on the family's tiny model (tests/families.py, the demo tokenizer, three
    prompts of 4-31 tokens, 10 new tokens in generate mode); ``hsx verify --recompute`` in hsx's own virtualenv
    finds every row of every column equal to its teacher-forced forward, each completion token is that forward's
    argmax, and a copy with one sample's rows moved by one position is caught (tests/lane_families.py)."""
    lane_families, models = family_models
    model, out = models[family], tmp_path / "out"
    run = ["--mode", mode] + (["--max-new-tokens", "10"] if mode == "generate" else [])
    done = CliRunner().invoke(app, [
        "extract", "--engine", "vllm", "--model", str(model), "--dataset", str(model / "data.jsonl"), "-o", str(out),
        "--id-field", "id", "--device", "cpu", "--model-dtype", "float32", "--dtype", "float32", "--layers",
        VLLM_FAMILIES[family][0], "--batch-size", "3", "--quiet", *run])
    assert done.exit_code == 0, done.output
    report = lane_families.check_in_hsx_venv(out, mode, VLLM_FAMILIES[family][1])
    print(f"[vllm {family} {mode}] {report['rows']} rows x {len(report['columns'])} columns, worst "
          f"{report['worst']:.2g} of the largest reference value, {report['greedy_tokens']} greedy tokens")
