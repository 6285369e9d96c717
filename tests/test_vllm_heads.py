"""One EAGLE3 head config, the same boundaries and rows on the transformers engine and on a real vLLM 0.32.

The demo's EAGLE3 head (:mod:`hsx.demo.spec_models`, SGLang's format, ids ``[1, 3, 5]`` = boundaries
2, 4, 6 by SGLang's rule) drafts for the transformers engine as it is; vLLM reads ids as boundaries and
cannot load its same-size ``d2t``, so it gets the head ``hsx export vllm-head`` writes (ids ``[2, 4, 6]``,
marked ``"vllm"``). Both extracts of the same prompts must record ``eagle3`` as boundaries 2, 4, 6 and
hold the same tokens and rows (fp32, within 1e-4 of the largest value). The transformers engine needs
transformers >= 5.24 and the lane pins 5.19, so it runs in hsx's own virtualenv (``$HSX_VENV``, default
``.venv``), as in tests/test_vllm_lane.py.

Runs inside the vLLM CPU lane only: ``bash scripts/vllm_cpu.sh python -m pytest -m vllm tests/test_vllm_heads.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("vllm", reason="runs inside the vLLM CPU lane: bash scripts/vllm_cpu.sh python -m pytest -m vllm")

from typer.testing import CliRunner  # noqa: E402

import hsx  # noqa: E402
from hsx.cli import app  # noqa: E402
from hsx.demo.spec_models import build_spec_models  # noqa: E402
from hsx.errors import HsxError  # noqa: E402

MAX_NEW = 10
TOLERANCE = 1e-4
WORDS = ["the cat sat on a mat", "speculative decoding", "hidden states are rows", "a b c d e f g"]
COMMON = ["--device", "cpu", "--model-dtype", "float32", "--dtype", "float32", "--layers", "final,eagle3",
          "--max-new-tokens", str(MAX_NEW), "--spec-num-steps", "3", "--batch-size", "3", "--quiet"]


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-heads")
    models = build_spec_models(root / "models")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": w * (i + 1)}) + "\n" for i, w in enumerate(WORDS)))
    head = root / "vllm-eagle3"
    run = CliRunner().invoke(app, ["export", "vllm-head", str(models.eagle3), str(head), "--model", str(models.target)])
    assert run.exit_code == 0, run.output
    return models, data, head, root


def hf_extract(models, data, draft: Path, out: Path) -> None:
    """``hsx extract --engine hf`` in hsx's own virtualenv (the lane's transformers is too old for that engine)."""
    python = Path(os.environ.get("HSX_VENV", ROOT / ".venv")) / "bin" / "python"
    assert python.exists(), f"{python}: hsx's virtualenv (bash scripts/setup.sh, or set HSX_VENV)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VIRTUAL_ENV", "PYTHONPATH"))}
    done = subprocess.run([str(python), "-c", "from hsx.cli import main; main()", "extract", "--model",
                           str(models.target), "--dataset", str(data), "-o", str(out), "--engine", "hf",
                           "--draft-model", str(draft), *COMMON], env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def outputs(work):
    models, data, head, root = work
    hf_extract(models, data, models.eagle3, root / "hf")  # the SGLang-format head, SGLang's rule
    hf_extract(models, data, head, root / "hf-vllm-head")  # the converted head, read by its marker
    run = CliRunner().invoke(app, ["extract", "--model", str(models.target), "--dataset", str(data), "-o",
                                   str(root / "vllm"), "--engine", "vllm", "--spec-algorithm", "EAGLE3",
                                   "--draft-model", str(head), *COMMON])
    assert run.exit_code == 0, run.output
    return {name: hsx.open(str(root / name)) for name in ("hf", "hf-vllm-head", "vllm")}


def eagle3_of(meta) -> dict:
    return next(g for g in meta["layers"] if g["name"] == "eagle3")


def test_the_same_head_gives_the_same_boundaries(outputs):
    for name, out in outputs.items():
        assert eagle3_of(out.metadata)["sources"] == [2, 4, 6], name
        assert out.metadata["speculative"]["aux_layers"]["boundaries"] == [2, 4, 6], name
    rules = {name: (out.metadata["speculative"]["aux_layers"]["aux_layer_ids_rule"],
                    out.metadata["speculative"]["aux_layers"]["rule_from"]) for name, out in outputs.items()}
    assert rules == {"hf": ("sglang", "engine default"), "hf-vllm-head": ("vllm", "marker"),
                     "vllm": ("vllm", "marker")}
    assert eagle3_of(outputs["hf"].metadata)["raw_ids"] == [1, 3, 5]
    assert eagle3_of(outputs["vllm"].metadata)["raw_ids"] == [2, 4, 6]
    assert outputs["vllm"].metadata["engine"]["name"] == "vllm" and outputs["hf"].metadata["engine"]["name"] == "hf"


def test_the_same_head_gives_the_same_rows(outputs):
    ref = outputs["hf"]
    ids = [s.sample_id for s in ref]
    assert len(ids) == len(WORDS)
    for name in ("hf-vllm-head", "vllm"):
        other = outputs[name]
        assert sorted(s.sample_id for s in other) == sorted(ids), name
        for sid in ids:
            a, b = ref[sid], other[sid]
            assert a.input_ids.tolist() == b.input_ids.tolist(), (name, sid)
            for column in ("eagle3", "final"):
                x, y = a.hidden(column).float(), b.hidden(column).float()
                assert x.shape == y.shape and x.shape[0] > 0, (name, sid, column)
                err = float((x - y).abs().max() / x.abs().max())
                assert err < TOLERANCE, (name, sid, column, err)


def test_vllm_refuses_a_head_marked_sglang(work, tmp_path):
    from hsx.config import ExtractConfig
    from hsx.engine.vllm.runner import VLLMRunner

    models, _, _, _ = work
    marked = tmp_path / "marked"
    marked.mkdir()
    cfg = json.loads((models.eagle3 / "config.json").read_text())
    cfg["hsx"] = {"aux_layer_ids_rule": "sglang", "aux_boundaries": [2, 4, 6]}
    (marked / "config.json").write_text(json.dumps(cfg))
    (marked / "model.safetensors").symlink_to(models.eagle3 / "model.safetensors")
    with pytest.raises(HsxError, match=rf"hsx export vllm-head {marked} DST"):
        VLLMRunner(ExtractConfig(model=str(models.target), engine="vllm", device="cpu", model_dtype="float32",
                                 layers="final,eagle3", spec_algorithm="EAGLE3", draft_model=str(marked)))


def test_a_run_over_the_vllm_output_reads_vllms_ids_by_vllms_rule(work, outputs):
    """``--engine vllm`` over an hsx output (its stored tokens) with ``--eagle3-layer-ids 2,4,6``: vLLM captures
    boundaries 2, 4, 6 and the run checks them against the source's ``eagle3`` (it used to read the ids with
    SGLang's + 1 and refuse: 'column eagle3 would hold sources [3, 5, 7]')."""
    models, _, _, root = work
    out = root / "again"
    run = CliRunner().invoke(app, ["extract", "--model", str(models.target), "--dataset", str(root / "vllm"), "-o",
                                   str(out), "--engine", "vllm",
                                   "--device", "cpu", "--model-dtype", "float32", "--dtype", "float32",
                                   "--layers", "final,eagle3", "--eagle3-layer-ids", "2,4,6", "--quiet"])
    assert run.exit_code == 0, run.output
    again, src = hsx.open(str(out)), outputs["vllm"]
    assert eagle3_of(again.metadata)["sources"] == [2, 4, 6]
    assert len(again) == len(src)
    for a in src:  # the run checked every row against the source's; the stored rows agree too
        b = again[a.sample_id]
        assert a.input_ids.tolist() == b.input_ids.tolist()
        x, y = a.hidden("eagle3").float(), b.hidden("eagle3").float()
        assert float((x - y).abs().max() / x.abs().max()) < TOLERANCE
