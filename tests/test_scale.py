"""hsx extract --ray: two workers on a local Ray (fractional CPUs: whole ones would hold both cores),
every sample exactly once and bit-identical to a single-process run, a worker SIGKILLed mid-unit,
the driver SIGKILLed and resumed, units and the import of hsx without Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError, ShardError
from hsx.run.pipeline import extract
from hsx.shards.manifest import load_manifest

ray = pytest.importorskip("ray")

NUM_ROWS = 240
BAD = {17: {"id": "r17", "text": "   "}, 101: {"id": "r101"}}  # empty text; no usable column
DUP = {150: "r20"}  # row 150 repeats row 20's id: an error record, as in one process


def _rows() -> list[dict]:
    rows = []
    for i in range(NUM_ROWS):
        row = {"id": f"r{i}", "text": f"Row {i}: " + "the mill and the river " * (i % 6) + "end."}
        rows.append(BAD.get(i, {**row, "id": DUP.get(i, row["id"])}))
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("scale")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=4, hidden_size=64, vocab_size=len(tok), seed=3,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return {"root": root, "model": str(root / "target"), "data": str(data)}


def _config(setup, out: Path, **kw) -> ExtractConfig:
    base = dict(model=setup["model"], dataset=setup["data"], output=str(out), id_field="id", dtype="float32",
                layers="final,2", max_new_tokens=10, batch_size=4, window=8, max_shard_samples=6)
    return ExtractConfig(**{**base, **kw})


RAY = dict(ray=True, num_workers=2, cpus_per_worker=0.5, unit_size=8)


@pytest.fixture(scope="module")
def reference(setup) -> Path:
    """The single-process run, with the one compute thread a Ray worker of <= 1 CPU gets (OMP_NUM_THREADS=1):
    on CPU the thread count changes how a matrix product is split, and so the last bits."""
    out = setup["root"] / "reference"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = extract(_config(setup, out), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary.samples == NUM_ROWS - len(BAD) - len(DUP) and summary.errors == len(BAD) + len(DUP)
    return out


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def assert_same_output(ref: Path, out: Path) -> None:
    a, b = hsx.open(ref), hsx.open(out)
    assert len(b) == len(set(b.sample_ids)), "a sample is in the output twice"
    assert sorted(b.sample_ids) == sorted(a.sample_ids)
    assert sorted((e.sample_id, e.source_index, e.reason) for e in b.errors) == \
        sorted((e.sample_id, e.source_index, e.reason) for e in a.errors)
    for sid in a.sample_ids:
        x, y = a.select([sid])[0], b.select([sid])[0]
        assert torch.equal(x.input_ids, y.input_ids), sid
        assert x.source_index == y.source_index and x.prompt_len == y.prompt_len, sid
        for name in a.columns:
            assert torch.equal(x.hidden(name).view(torch.int32), y.hidden(name).view(torch.int32)), (sid, name)
    result = CliRunner().invoke(app, ["verify", str(out)])
    assert result.exit_code == 0, result.output


def _descendants(pid: int) -> list[int]:
    kids = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    found, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def _committed(out: Path) -> int:
    try:
        return len(load_manifest(out).shards)
    except ShardError:
        return 0


def test_units_are_windows_and_a_repeated_id_joins_its_first_row():
    from hsx.run.scale.units import plan_units

    cfg = ExtractConfig(model="m", dataset="d", output="o", batch_size=2, unit_size=4)
    ids = ["a", "b", "c", "d", "e", "a", None, "h", "i", "c"]
    units = plan_units(cfg, ids, len(ids))
    assert [u.rows for u in units] == [[0, 1, 2, 3, 5, 9], [4, 6, 7], [8]]
    assert units[1].ids == ["e", "train:6", "h"]
    assert [u.rows for u in plan_units(cfg, None, 5)] == [[0, 1, 2, 3], [4]]
    # units hold whole scheduling windows (by default 32 batches)
    assert ExtractConfig(batch_size=4).window_rows == 128 == ExtractConfig(batch_size=4, unit_size=256).window_rows
    with pytest.raises(HsxError, match=r"multiple of the scheduling window \(128 rows"):
        ExtractConfig(model="m", dataset="d", output="o", batch_size=4, unit_size=8, ray=True).validate()
    with pytest.raises(HsxError, match="multiple of the scheduling window"):
        ExtractConfig(model="m", dataset="d", output="o", batch_size=4, window=4, unit_size=6, ray=True).validate()


def test_hsx_and_its_cli_import_without_ray():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import hsx, hsx.cli, hsx.run.pipeline, hsx.run.scale\n"
            "from hsx.config import ExtractConfig\n"
            "try:\n"
            "    hsx.run.scale.extract_ray(ExtractConfig(model='m', dataset='d', output='o', ray=True))\n"
            "except hsx.HsxError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install ray (from a checkout: pip install -e '.[ray]')" in out.stdout


@pytest.mark.slow
def test_two_workers_equal_one_process_and_resume(setup, reference, local_ray, tmp_path):
    out = tmp_path / "ray"
    summary = extract(_config(setup, out, **RAY), progress=False)
    assert summary.workers == 2 and summary.retried == 0
    assert summary.samples == NUM_ROWS - len(BAD) - len(DUP) and summary.errors == len(BAD) + len(DUP)
    assert_same_output(reference, out)
    m = load_manifest(out)
    assert m.complete and len({s.file.split("-")[1] for s in m.shards}) == NUM_ROWS // 8
    # plain readers see the shards in unit order, each unit's samples in order: dataset order
    assert list(pd.read_parquet(out, columns=["sample_id"])["sample_id"]) == hsx.open(out).sample_ids
    again = extract(_config(setup, out, **RAY), progress=False)
    assert again.samples == 0 and again.resumed == NUM_ROWS
    with pytest.raises(HsxError, match="different configuration"):
        extract(_config(setup, out, layers="final", **RAY), progress=False)


@pytest.mark.slow
def test_worker_killed_mid_unit_is_retried_elsewhere(setup, reference, local_ray, tmp_path):
    out = tmp_path / "killed-worker"
    result: dict = {}

    def run():
        try:
            result["summary"] = extract(_config(setup, out, **RAY), progress=False)
        except BaseException as e:  # reported below
            result["error"] = e

    driver = threading.Thread(target=run)
    driver.start()
    victim, deadline = None, time.monotonic() + 300
    while victim is None and driver.is_alive() and time.monotonic() < deadline:
        if _committed(out) >= 3:  # mid-run, not while the engines load
            busy = [p for p in _descendants(os.getpid()) if _title(p) == "ray::ExtractWorker.run_unit"]
            if busy:
                victim = busy[0]
                os.kill(victim, signal.SIGKILL)
        time.sleep(0.01)
    driver.join(timeout=600)
    assert victim is not None, "the run finished before a worker could be killed"
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    assert summary.retried >= 1, "the killed worker's unit was not retried"
    assert_same_output(reference, out)


@pytest.mark.slow
def test_driver_killed_then_resumed(setup, reference, local_ray, tmp_path, caplog):
    out = tmp_path / "killed-driver"
    args = ["extract", "--model", setup["model"], "--dataset", setup["data"], "--id-field", "id", "-o", str(out),
            "--dtype", "float32", "--layers", "final,2", "--max-new-tokens", "10", "--batch-size", "4", "--window", "8",
            "--max-shard-samples", "6", "--quiet"]
    ray_args = ["--ray-address", "local", "--num-workers", "2", "--cpus-per-worker", "0.5", "--unit-size", "8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "from hsx.cli import main; main()", *args, *ray_args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and _committed(out) < 4:
            tree.update(_descendants(proc.pid))
            time.sleep(0.02)
        tree.update(_descendants(proc.pid))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        for pid in tree:  # Ray's agents outlive a killed driver; these are this test's own processes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    partial = load_manifest(out)
    assert not partial.complete and 0 < partial.num_samples < NUM_ROWS - len(BAD) - len(DUP)
    assert (out / ".hsx.lock").exists()

    with caplog.at_level("WARNING", logger="hsx"):
        loud = [a for a in args if a != "--quiet"]  # the summary says what was resumed
        resumed = CliRunner().invoke(app, [*loud, "--ray", *ray_args[2:]])
    assert resumed.exit_code == 0, resumed.output
    assert f"pid {proc.pid}" in caplog.text and "took over the lock" in caplog.text
    assert "resumed:" in resumed.output
    assert not (out / ".hsx.lock").exists()
    assert_same_output(reference, out)


def test_driver_refuses_a_shard_it_cannot_see_or_a_second_commit(tmp_path):
    from hsx.run.scale.ray_runner import _commit
    from hsx.run.scale.units import Unit
    from hsx.shards.manifest import Manifest

    (tmp_path / ".shard-000001-aaaa-00.parquet.part").write_bytes(b"x" * 10)  # a worker's shard, staged
    entry = {"file": "shard-000001-aaaa-00.parquet", "samples": 1, "rows": 3, "tokens": 4, "bytes": 10,
             "xxh3_128": "0", "sample_ids": ["s1"]}
    unit = Unit(1, [1], ["s1"])
    m = Manifest(metadata={})
    with pytest.raises(HsxError, match="not visible here"):
        _commit(tmp_path, m, unit, {"host": "h", "shards": [{**entry, "file": "shard-gone.parquet"}], "errors": []}, set())
    with pytest.raises(HsxError, match="worker on host h wrote 11"):
        _commit(tmp_path, m, unit, {"host": "h", "shards": [{**entry, "bytes": 11}], "errors": []}, set())
    done: set[str] = set()
    _commit(tmp_path, m, unit, {"host": "h", "shards": [entry], "errors": []}, done)
    assert [s.file for s in load_manifest(tmp_path).shards] == [entry["file"]] and done == {"s1"}
    # committed, then renamed to its visible name
    assert (tmp_path / entry["file"]).exists() and not (tmp_path / ".shard-000001-aaaa-00.parquet.part").exists()
    with pytest.raises(HsxError, match="refusing to commit twice"):
        _commit(tmp_path, m, unit, {"host": "h", "shards": [entry], "errors": []}, done)
    assert len(load_manifest(tmp_path).shards) == 1


@pytest.mark.slow
def test_more_workers_than_the_cluster_holds_is_refused(setup, local_ray, tmp_path):
    with pytest.raises(HsxError, match="need 8 CPUs; the Ray cluster has 2"):
        extract(_config(setup, tmp_path / "o", **{**RAY, "num_workers": 8, "cpus_per_worker": 1.0}), progress=False)
    assert not (tmp_path / "o").exists()
