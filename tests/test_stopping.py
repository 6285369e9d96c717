"""Runs that stop or cannot start: SIGTERM stops ``hsx extract`` as Ctrl-C does (drain, commit, resume to
the bits of an uninterrupted run), an output that cannot be written is refused in one line, and
``hsx verify`` says that a run is incomplete while it checks what is committed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app, main
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError
from hsx.shards import Manifest, ShardSink
from hsx.storage.lock import LOCK, OutputLock
from hsx.shards.manifest import load_manifest
from shard_fixtures import bits, finite_records, make_metadata, write_sink

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = Path(hsx.__file__).parent / "demo_data" / "prompts.jsonl"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

# ``hsx ARGV[1:]`` in a child whose main thread stops for good, between two samples, once the manifest on
# disk commits a shard (after 12 samples: with the two lanes of a 2-core machine the first shard of 4
# commits when the third row group is handed out), and says so on stdout; a signal still reaches it there.
# Test code in the child: the library has no test hooks.
HOLD = """
import sys, time
import hsx.run.pipeline as pipeline
from hsx.shards.manifest import load_manifest
real = pipeline.write_results
def write_results(items, sink, summary, after=lambda item: None):
    def hold(item):
        after(item)
        if summary.samples < 12:
            return
        while not load_manifest(sink.dir).shards:
            time.sleep(0.01)
        print("held", flush=True)
        while True:
            time.sleep(60)
    real(items, sink, summary, hold)
pipeline.write_results = write_results
from hsx.cli import main
sys.argv = ["hsx", *sys.argv[1:]]
main()
"""

# The same for the Ray driver: it holds once it has committed its first unit.
HOLD_RAY = """
import sys, time
import hsx.run.scale.ray_runner as runner
real = runner._commit
def commit(*args):
    real(*args)
    print("held", flush=True)
    while True:
        time.sleep(60)
runner._commit = commit
from hsx.cli import main
sys.argv = ["hsx", *sys.argv[1:]]
main()
"""


def build_model(root: Path) -> str:
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=len(tok), seed=2,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("stopping_model"))


def extract_args(model: str, out: Path, *extra: str) -> list[str]:
    return ["extract", "--model", model, "--dataset", str(PROMPTS), "--output", str(out), "--id-field", "id",
            "--mode", "prefill", "--batch-size", "1", "--max-shard-samples", "4", *extra]


def held(hold: str, args: list[str]) -> subprocess.Popen:
    """``hsx ARGS`` held at ``hold``; returns once it holds (fails if it ended first)."""
    proc = subprocess.Popen([sys.executable, "-c", hold, *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "held":
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run ended before it held (stdout {line!r}):\n{err[-3000:]}")
    return proc


def hsx_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsx.cli", *args], env=ENV, capture_output=True, text=True,
                          timeout=600)


def incomplete_note(samples: int) -> str:
    return (f"  note   the run is incomplete (in progress, or stopped): {samples:,} samples committed; "
            "re-run the same hsx extract command to resume")


def assert_stopped_by_sigterm(proc: subprocess.Popen, out: Path) -> Manifest:
    """SIGTERM to a held run: exit 143, one line naming what is committed, the shards sound, the lock gone."""
    before = load_manifest(out).num_samples
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 143, stderr
    m = load_manifest(out)
    assert not m.complete and before <= m.num_samples < 40
    assert "Traceback" not in stderr and stdout == "", stderr  # (its "held" read already)
    assert stderr.strip().splitlines()[-1] == (f"interrupted by SIGTERM: {m.num_samples:,} samples committed to "
                                               f"{out}; re-run the same command to resume"), stderr
    assert not (out / LOCK).exists()
    checked = CliRunner().invoke(app, ["verify", str(out)])
    assert checked.exit_code == 0, checked.output
    assert incomplete_note(m.num_samples) in checked.output.splitlines() and "verify: OK" in checked.output
    return m


def assert_same_output(ref: Path, out: Path) -> None:
    a, b = hsx.open(ref), hsx.open(out)
    assert b.sample_ids == a.sample_ids and len(a) == 40
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids), x.sample_id
        for name in a.columns:
            assert torch.equal(bits(x.hidden(name)), bits(y.hidden(name))), (x.sample_id, name)


# --------------------------------------------------------------------------- SIGTERM

@pytest.mark.slow
def test_sigterm_commits_what_is_finished_and_the_same_command_resumes_to_an_uninterrupted_run(model_dir, tmp_path):
    out, ref = tmp_path / "out", tmp_path / "ref"
    m = assert_stopped_by_sigterm(held(HOLD, extract_args(model_dir, out, "--quiet")), out)
    assert m.num_samples >= 4

    again = hsx_cli(*extract_args(model_dir, out))
    assert again.returncode == 0, again.stderr
    assert f"resumed: {m.num_samples:,} samples were already done" in again.stdout, again.stdout
    assert load_manifest(out).complete
    whole = hsx_cli(*extract_args(model_dir, ref, "--quiet"))
    assert whole.returncode == 0, whole.stderr
    assert_same_output(ref, out)


@pytest.mark.slow
def test_sigterm_stops_the_ray_driver_the_same_way(model_dir, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "out"
    ray_args = ["--ray-address", "local", "--num-workers", "2", "--cpus-per-worker", "0.5", "--unit-size", "8",
                "--window", "8"]
    assert_stopped_by_sigterm(held(HOLD_RAY, extract_args(model_dir, out, "--quiet", *ray_args)), out)


def test_the_sigterm_handler_is_put_back_after_the_run(model_dir, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(app, extract_args(model_dir, tmp_path / "out", "--quiet", "--limit", "2"))
    assert result.exit_code == 0, result.output
    assert signal.getsignal(signal.SIGTERM) is before


# --------------------------------------------------------------------------- an output that cannot be written

def run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["hsx", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def refusal(out: Path, reason: str) -> str:
    return f"error: cannot write to {out}: {reason} (the output directory must be writable)\n"


def test_a_file_in_the_way_of_the_output_is_refused_in_one_line(model_dir, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    cases = {blocker / "out": f"{blocker} is a file, not a directory", blocker: "it is a file, not a directory"}
    for out, reason in cases.items():
        code, err = run_main(monkeypatch, capsys, extract_args(model_dir, out, "--quiet"))
        assert code == 2 and err == refusal(out, reason)
    with pytest.raises(HsxError, match=re.escape(f"cannot write to {blocker / 'out'}: Not a directory")):
        OutputLock(blocker / "out").acquire()  # where the run creates it, should the check above be passed


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 directory regardless of its mode")
def test_an_unwritable_output_is_refused_in_one_line(model_dir, tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        for out, reason in {locked: "Permission denied",
                            locked / "out": f"Permission denied in {locked}, where it would be created"}.items():
            code, err = run_main(monkeypatch, capsys, extract_args(model_dir, out, "--quiet"))
            assert code == 2 and err == refusal(out, reason)
        assert list(locked.iterdir()) == []
    finally:
        os.chmod(locked, 0o755)


def test_an_output_on_a_read_only_mount_is_refused_in_one_line(model_dir, tmp_path, monkeypatch, capsys):
    """The directory answers as on a read-only mount, which refuses root too: no write access (EROFS), and
    statvfs flags it read-only."""
    mount = tmp_path / "mount"
    mount.mkdir()
    access, statvfs = os.access, os.statvfs
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: not (mode & os.W_OK and Path(p) == mount) and access(p, mode, **kw))
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY) if Path(p) == mount else statvfs(p))
    for out, reason in {mount: "Read-only file system",
                        mount / "out": f"Read-only file system in {mount}, where it would be created"}.items():
        code, err = run_main(monkeypatch, capsys, extract_args(model_dir, out, "--quiet"))
        assert code == 2 and err == refusal(out, reason)
    assert list(mount.iterdir()) == []


def test_an_output_on_a_real_read_only_mount_is_refused_in_one_line(model_dir, tmp_path, monkeypatch, capsys):
    """A tmpfs mounted read-only, where this machine lets the tests mount one (root): it refuses root too."""
    mount = tmp_path / "ro-mount"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True, text=True) \
        if os.geteuid() == 0 else None
    if done is None or done.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here ({done.stderr.strip() if done else 'not root'})")
    try:
        for out, reason in {mount: "Read-only file system",
                            mount / "out": f"Read-only file system in {mount}, where it would be created"}.items():
            code, err = run_main(monkeypatch, capsys, extract_args(model_dir, out, "--quiet"))
            assert code == 2 and err == refusal(out, reason)
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# --------------------------------------------------------------------------- verify on an incomplete run

def test_verify_says_a_run_is_incomplete_and_checks_what_is_committed(tmp_path):
    meta = make_metadata([8, 4])
    records = finite_records(meta, [5, 6, 7, 9, 4], seed=3)
    sink = ShardSink(tmp_path / "stopped", Manifest(meta), max_shard_samples=2)
    for r in records:
        sink.add(r)
    sink.close(complete=False)
    write_sink(tmp_path / "done", meta, records, max_shard_samples=2)

    stopped = CliRunner().invoke(app, ["verify", str(tmp_path / "stopped")])
    assert stopped.exit_code == 0, stopped.output
    lines = stopped.output.splitlines()
    assert lines[-2:] == [incomplete_note(5), "verify: OK"] and sum(x.startswith("  ok ") for x in lines) == 3
    done = CliRunner().invoke(app, ["verify", str(tmp_path / "done")])
    assert done.exit_code == 0 and "incomplete" not in done.output, done.output

    as_json = json.loads(CliRunner().invoke(app, ["verify", str(tmp_path / "stopped"), "--json"]).output)
    assert as_json["ok"] is True and as_json["complete"] is False and as_json["samples"] == 5
    one_file = tmp_path / "stopped" / load_manifest(tmp_path / "stopped").shards[0].file
    assert json.loads(CliRunner().invoke(app, ["verify", str(one_file), "--json"]).output)["complete"] is None
