"""The benchmark scripts run end to end at tiny sizes and write finite, positive ratios (no timing checks)."""

from __future__ import annotations

import json
import math
import os
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
