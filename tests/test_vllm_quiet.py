"""What ``hsx extract --engine vllm`` prints: with ``-q`` nothing at all, without it one bar and one
summary (no line of vLLM's own), and a model vLLM's CPU attention cannot run ends in one ``error:``
line naming the model, the limit and what to do. Runs inside the vLLM CPU lane only:
``bash scripts/vllm_cpu.sh python -m pytest -m vllm tests/test_vllm_quiet.py``. The CLI runs as a
process of its own, as a user runs it: vLLM configures its logging when it is first imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="runs inside the vLLM CPU lane: bash scripts/vllm_cpu.sh python -m pytest -m vllm")

from hsx.demo.models import build_tiny_llama  # noqa: E402
from hsx.demo.tokenizer import build_demo_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD = 600  # seconds: a guard against a hang only


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-quiet")
    tok = build_demo_tokenizer()
    for name, heads in (("model", 2), ("head16", 4)):  # hidden 64: head_dim 32 (vLLM's CPU attention runs it), 16
        model = build_tiny_llama(num_layers=2, hidden_size=64, vocab_size=len(tok), seed=1, num_attention_heads=heads,
                                 num_key_value_heads=heads, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "data.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": f"Row {i} of the mill."}) + "\n"
                                             for i in range(4)))
    return root


def hsx_extract(folder: Path, model: str, out: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    env["PYTHONPATH"] = str(ROOT)
    args = ["extract", "--engine", "vllm", "--device", "cpu", "--model", str(folder / model), "--dataset",
            str(folder / "data.jsonl"), "--id-field", "id", "-o", str(folder / out), "--max-new-tokens", "4", *extra]
    return subprocess.run([sys.executable, "-c", "from hsx.cli import main; main()", *args], env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD)


def test_quiet_prints_nothing(folder):
    done = hsx_extract(folder, "model", "out-quiet", "-q")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "" and done.stderr == "", (done.stdout[-3000:], done.stderr[-3000:])


def test_a_run_prints_one_bar_and_one_summary(folder):
    done = hsx_extract(folder, "model", "out-plain")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("wrote 4 samples") and "shards on disk" in done.stdout, done.stdout
    assert not [ln for ln in done.stdout.splitlines() if "INFO" in ln or "WARNING" in ln], done.stdout
    bar = done.stderr.replace("\r", "\n").strip().splitlines()
    assert bar and all("sample" in ln for ln in bar), done.stderr[-3000:]  # tqdm's redraws of the one bar


def test_a_head_size_vllm_cannot_run_is_one_line(folder):
    done = hsx_extract(folder, "head16", "out-head16", "-q")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[0].startswith(f"error: --model {folder / 'head16'}: vLLM ") and "cannot run head_dim 16" in lines[0]
    assert "(it runs 32, 64" in lines[0] and "use --engine hf" in lines[0], lines[0]
