"""The benchmark scripts run end to end at tiny sizes and write finite, positive ratios (no timing checks)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_scripts_run_and_write_ratios(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    extract_json, gpu_out = tmp_path / "extract.json", tmp_path / "gpu"
    runs = {
        "bench_extract": [sys.executable, str(ROOT / "scripts/bench_extract.py"), "--quick", "--repeats", "1",
                          "--threads", "1", "--only", "generate", "--prompts", "2", "--max-new-tokens", "4",
                          "--work", str(tmp_path / "work"), "--json", str(extract_json)],
        "bench_gpu": [sys.executable, str(ROOT / "scripts/bench_gpu.py"), "--tiny", "--prompts", "2",
                      "--out", str(gpu_out)],
    }
    # both at once: each is mostly process start-up, which the two cores share well
    procs = {name: subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, cmd in runs.items()}
    for name, p in procs.items():
        output = p.communicate(timeout=300)[0]
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{output[-4000:]}"

    report = json.loads(extract_json.read_text())
    # one comparison keeps the test short (each side is a whole process); bench_gpu below runs the
    # same kind of prefill comparison as bench_extract's
    assert set(report) == {"settings", "whole_process", "generate", "writer_blocked_s"}
    waits = [w for runs in report["writer_blocked_s"].values() for w in runs]
    assert waits and all(math.isfinite(w) and w >= 0 for w in waits)  # printed by every hsx extract run
    gen = report["generate"]
    for key in ("ratio_median", "ratio_min"):
        assert math.isfinite(gen[key]) and gen[key] > 0, (key, gen)
    assert gen["target"] == 1.3
    for side in gen["sides"].values():
        assert side["counts"]["new_tokens"] == 2 * 4

    gpu = json.loads((gpu_out / "bench_gpu.json").read_text())
    for key in ("ratio_hsx_to_bare", "bare_tokens_per_s", "hsx_tokens_per_s", "hsx_bytes_per_s"):
        assert math.isfinite(gpu[key]) and gpu[key] > 0, (key, gpu[key])
    assert gpu["bare"]["tokens"] == gpu["hsx"]["tokens"] == gpu["tokens"]
    assert gpu["hsx"]["run_s"] > 0 and gpu["hsx"]["writer_blocked_s"] >= 0  # from hsx extract's own summary
    assert not (gpu_out / "hsx_out").exists()  # shards are deleted unless --keep-output


def test_writer_rate_runs_and_reports_each_lane_count():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_writer_rate.py"), "--mb", "3", "--lanes",
                           "1,2", "--hidden", "64", "--tokens", "20"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("[writer]")]
    assert [x.split(", ")[1].split(" ")[0] for x in lines] == ["1", "2"]
    for line in lines:
        mb_s = float(line.split(" = ")[1].split(" MB/s")[0])
        assert mb_s > 0 and "cores at that rate" in line


def per_step_report(path: Path, labels: list[str], batches: list[int], repeats: int) -> list[dict]:
    """The per-step JSON: one entry per case and batch, its raw runs and a summary that follows from them."""
    report = json.loads(path.read_text())
    assert report["mode"] == "per-step" and report["settings"]["repeats"] == repeats
    cases = report["cases"]
    assert [(c["case"], c["batch"]) for c in cases] == [(label, b) for label in labels for b in batches]
    for c in cases:
        runs, s = c["runs"], c["summary"]
        assert len(runs["plain"]) == len(runs["hsx"]) == repeats
        every = runs["plain"] + runs["hsx"]
        assert {r["tokens"] for r in every} == {every[0]["tokens"]} and every[0]["tokens"] > 0
        assert s["steps"] == max(r["steps"] for r in every) >= 1
        plain_ms = statistics.median(1e3 * r["wall"] / s["steps"] for r in runs["plain"])
        assert s["plain_ms"] == pytest.approx(plain_ms)
        assert s["own_share"] == pytest.approx((s["in_step_ms"] + s["after_ms"]) / s["plain_ms"])
        for key in ("plain_ms", "after_ms", "own_share"):
            assert math.isfinite(s[key]) and s[key] > 0, (c["case"], c["batch"], key, s[key])
        assert math.isfinite(s["in_step_ms"]) and s["in_step_ms"] >= 0
    return cases


@pytest.mark.vllm
def test_vllm_per_step_bench_through_bench_gpu_writes_its_numbers(tmp_path):
    """bench_gpu.sh --vllm, the GPU comparison, run on the CPU: its options after MODEL_DIR win."""
    pytest.importorskip("vllm", reason="runs inside the vLLM CPU lane: bash scripts/vllm_cpu.sh python -m pytest -m vllm")
    from hsx.demo.spec_models import build_spec_models

    models = build_spec_models(tmp_path / "models")
    out = tmp_path / "per-step.json"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "bench_gpu.sh"), "--vllm", str(models.target), "--device",
                           "cpu", "--model-dtype", "float32", "--batches", "1,3", "--repeats", "1", "--new-tokens", "3",
                           "--json", str(out)], env={**os.environ, "PYTHON": sys.executable}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "the shard writer wrote them at" in done.stdout
    for c in per_step_report(out, ["target plain"], [1, 3], 1):
        s, hsx_run = c["summary"], c["runs"]["hsx"][0]
        width = 4 * 128 * 2  # final, b2, b4, b6 of the demo target's hidden 128, bf16
        assert hsx_run["bytes"] > 0 and hsx_run["bytes"] % width == 0
        assert s["writer_bytes_per_s"] == pytest.approx(hsx_run["bytes"] / hsx_run["wall"])
        assert s["written_raw_bytes_per_s"] == pytest.approx(hsx_run["bytes"] / hsx_run["write_s"])
        assert s["written_disk_bytes_per_s"] == pytest.approx(hsx_run["written_disk_bytes"] / hsx_run["write_s"])
        assert hsx_run["written_disk_bytes"] > 0
        for key in ("plain_tokens_per_s", "hsx_tokens_per_s"):
            assert math.isfinite(s[key]) and s[key] > 0


@pytest.mark.sglang
def test_sglang_per_step_bench_writes_its_numbers(tmp_path):
    pytest.importorskip("sglang", reason="runs inside the SGLang CPU lane: bash scripts/sglang_cpu.sh python -m pytest -m sglang")
    out = tmp_path / "per-step.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_sglang.py"), "--per-step", "--cases", "plain",
                           "--batches", "1,3", "--repeats", "1", "--new-tokens", "3", "--work", str(tmp_path / "work"),
                           "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    per_step_report(out, ["demo plain"], [1, 3], 1)
