"""One writer per output directory: a second hsx extract is refused naming the first; a lock left
by a killed process is taken over; a clean run leaves no lock behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import held_run
from hsx.cli import app
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError
from hsx.storage.lock import LOCK, OutputLock
from hsx.shards.manifest import load_manifest

HOLD = ("import sys, time; from hsx.storage.lock import OutputLock\n"
        "lock = OutputLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)\n")


def _holder(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_lock_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "out"
    with OutputLock(out) as first:
        holder = json.loads((out / LOCK).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(HsxError) as e:
            OutputLock(out).acquire()
        msg = str(e.value)
        assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and holder["started"] in msg
        assert first.taken_over is None
    assert not out.exists(), "a lock that created the directory and wrote nothing leaves nothing"


def test_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    proc = _holder(out)
    with pytest.raises(HsxError, match=f"pid {proc.pid}"):
        OutputLock(out).acquire()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((out / LOCK).read_text())["pid"] == proc.pid  # the dead holder's file is still there
    with caplog.at_level("WARNING", logger="hsx"):
        lock = OutputLock(out).acquire()
    assert lock.taken_over["pid"] == proc.pid and f"pid {proc.pid}" in caplog.text
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / LOCK).exists() and out.exists()


def test_lock_released_by_its_holder_is_not_taken_over(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    OutputLock(out).acquire().release()
    again = OutputLock(out).acquire()
    assert again.taken_over is None
    again.release()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lock-model")
    tok = build_demo_tokenizer()
    m = build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=len(tok), seed=5,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    m.save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


def test_two_concurrent_extracts_the_second_is_refused(model, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "text": f"Line {i} of the test."}) + "\n" for i in range(16)))
    out = tmp_path / "out"
    args = ["extract", "--model", model, "--dataset", str(data), "--id-field", "id", "-o", str(out),
            "--max-new-tokens", "8", "--batch-size", "2", "--max-shard-samples", "4", "--quiet"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    first = held_run.start(held_run.AFTER_LOCK, args, env)  # holds the lock until killed
    try:
        second = CliRunner().invoke(app, args)
        said = second.output + str(second.exception)
        assert second.exit_code != 0 and isinstance(second.exception, HsxError), said
        assert f"pid {first.pid} on host {socket.gethostname()}" in said and "started" in said
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    # the killed run's lock is stale now: a third run takes it over and finishes the output
    third = CliRunner().invoke(app, args)
    assert third.exit_code == 0, third.output
    m = load_manifest(out)
    assert m.complete and m.num_samples == 16 and not (out / LOCK).exists()
