"""Outputs in an S3-compatible object store, against a real SeaweedFS server on 127.0.0.1
(tests/s3_server.py): conditional commits, what plain readers see, hsx extract and resume, one
writer at a time (the lease), and the store stopped mid-run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from hsx.shards import Manifest, ShardSink
from hsx.storage.lease import LEASE, Lease
from hsx.shards.manifest import MANIFEST, load_manifest
from hsx.storage.store import ObjectStore, as_path
from s3_server import S3Server, s3_env, s3_server  # noqa: F401  (fixtures)
from shard_fixtures import bits, make_metadata, random_records

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = Path(hsx.__file__).parent / "demo_data" / "prompts.jsonl"
HANG_GUARD_S = 120.0


def visible_parquet(server, prefix: str) -> set[str]:
    """The ``*.parquet`` names a directory reader would list under ``prefix``."""
    keys = server.client().list_objects_v2(Bucket=server.bucket, Prefix=f"{prefix}/").get("Contents", [])
    names = {k["Key"][len(prefix) + 1:] for k in keys}
    return {n for n in names if n.endswith(".parquet") and not n.startswith((".", "_")) and "/" not in n}


def uri(server, prefix: str) -> str:
    return f"s3://{server.bucket}/{prefix}"


# --------------------------------------------------------------------------- the store and the commit

def test_only_one_of_two_writers_commits_the_manifest(s3_env):
    """Two processes' views of one manifest (two store objects, each with its own ETags): the first
    commit wins, the second is refused, and the manifest holds the first."""
    first, second = ObjectStore(s3_env.bucket), ObjectStore(s3_env.bucket)
    key = "two-writers/" + MANIFEST
    from hsx.storage.store import ObjectPath

    a, b = ObjectPath(first, key), ObjectPath(second, key)
    a.commit_bytes(b'{"v": 0}')  # none yet: If-None-Match
    with pytest.raises(HsxError, match="changed by another writer"):
        b.commit_bytes(b'{"v": "b0"}')  # b never read it: it must not exist
    assert a.read_bytes() == b.read_bytes() == b'{"v": 0}'  # both have read it now
    a.commit_bytes(b'{"v": 1}')
    with pytest.raises(HsxError, match="changed by another writer"):
        b.commit_bytes(b'{"v": "b1"}')  # b's ETag is stale
    assert b.read_bytes() == b'{"v": 1}'
    b.commit_bytes(b'{"v": 2}')
    assert a.read_bytes() == b'{"v": 2}'
    ObjectPath(ObjectStore(s3_env.bucket), key).unlink()  # a third process removes it
    with pytest.raises(HsxError, match="changed by another writer"):
        a.commit_bytes(b'{"v": 3}')  # If-Match on a deleted object


def test_plain_readers_see_committed_shards_only(s3_env):
    """After every record added, the visible ``*.parquet`` names are exactly the manifest's shards, and
    pandas reads exactly their samples; hsx.open gives back the bits written."""
    import pandas as pd

    meta = make_metadata([8, 16])
    records = random_records(meta, [5, 9, 3, 7, 2, 11, 4], "none", 0)
    out = uri(s3_env, "visible")
    sink = ShardSink(out, Manifest(meta), max_shard_samples=2)
    for r in records:
        sink.add(r)
        committed = {s.file for s in sink.manifest.shards}
        assert visible_parquet(s3_env, "visible") == committed
        if committed:
            assert set(load_manifest(out).done_ids()) == {i for s in sink.manifest.shards for i in s.sample_ids}
            # s3fs keeps listings per process; a reader polling one output as it grows turns that off
            seen = pd.read_parquet(out + "/", columns=["sample_id"],
                                   storage_options={"client_kwargs": {"endpoint_url": s3_env.endpoint},
                                                    "use_listings_cache": False, "skip_instance_cache": True})
            assert sorted(seen["sample_id"]) == sorted(i for s in sink.manifest.shards for i in s.sample_ids)
    sink.close()
    ds = hsx.open(out)
    assert ds.sample_ids == [r.sample_id for r in records] and len(load_manifest(out).shards) == 4
    for r, s in zip(records, ds):
        for name in ds.columns:
            assert torch.equal(bits(r.hidden[name]), bits(s.hidden(name))), (r.sample_id, name)


def test_a_shard_committed_before_its_copy_is_read_and_published(s3_env, monkeypatch):
    """A crash between the manifest's commit and the copy to the visible name: hsx.open reads the shard
    from its staging name, and the next sink on the output publishes it."""
    import hsx.shards.sink as sink_module

    meta = make_metadata([8])
    records = random_records(meta, [4, 6], "none", 1)
    out = uri(s3_env, "unpublished")
    publish = sink_module.publish
    monkeypatch.setattr(sink_module, "publish", lambda directory, shards: None)
    sink = ShardSink(out, Manifest(meta))
    for r in records:
        sink.add(r)
    sink.close()
    assert visible_parquet(s3_env, "unpublished") == set()
    assert [s.sample_id for s in hsx.open(out)] == ["s000", "s001"]
    monkeypatch.setattr(sink_module, "publish", publish)
    ShardSink(out, load_manifest(out)).abort()
    assert visible_parquet(s3_env, "unpublished") == {"shard-00000.parquet"}
    assert [s.sample_id for s in hsx.open(out)] == ["s000", "s001"]


def test_another_runs_output_is_refused_then_replaced_with_overwrite(s3_env):
    from hsx.config import ExtractConfig
    from hsx.run.output import prepare_output

    meta = make_metadata([8])
    out = uri(s3_env, "overwrite")
    sink = ShardSink(out, Manifest(meta, config_hash="another-run"))
    for r in random_records(meta, [4, 6], "none", 2):
        sink.add(r)
    sink.close()
    cfg = ExtractConfig(model="m", dataset="d", output=out)
    with pytest.raises(HsxError, match="holds a run with a different configuration"):
        prepare_output(as_path(out), cfg, overwrite=False)
    assert visible_parquet(s3_env, "overwrite") == {"shard-00000.parquet"}
    assert prepare_output(as_path(out), cfg, overwrite=True) is None
    assert s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="overwrite/").get("KeyCount") == 0


def test_a_location_with_credentials_is_refused_without_echoing_them():
    with pytest.raises(HsxError) as e:
        as_path("s3://AKIDSECRET:hunter2@bucket/prefix")
    assert "hunter2" not in str(e.value) and "AKIDSECRET" not in str(e.value)


# --------------------------------------------------------------------------- hsx extract

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("store_model")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=len(tok), seed=2,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


@pytest.mark.parametrize("location", ["gs://bucket/prefix", "hf://datasets/me/states", "az://c/p"])
def test_another_scheme_is_refused_not_taken_for_a_local_folder(tmp_path, monkeypatch, model_dir, location):
    monkeypatch.chdir(tmp_path)
    scheme = location.split("://")[0]
    with pytest.raises(HsxError, match=f"{location}: hsx reads and writes local paths and s3:// locations .* not {scheme}://"):
        as_path(location)
    for args in (["extract", "--model", model_dir, "--dataset", str(PROMPTS), "--output", location],
                 ["inspect", location], ["verify", location]):
        got = CliRunner().invoke(app, args)  # hsx's main() prints an HsxError as "error: ..." and exits 2
        assert isinstance(got.exception, HsxError) and f"not {scheme}://" in str(got.exception), (args, got.output)
    with pytest.raises(HsxError, match=f"not {scheme}://"):
        hsx.open(location)
    assert not list(tmp_path.iterdir())  # no folder named "gs:" (or any) made here
    assert as_path(f"file://{tmp_path}/out") == tmp_path / "out"


def extract_args(model: str, out: str, *extra: str) -> list[str]:
    return ["extract", "--model", model, "--dataset", str(PROMPTS), "--output", out, "--id-field", "id",
            "--mode", "prefill", "--batch-size", "1", "--max-shard-samples", "4", "--quiet", *extra]


@pytest.fixture(scope="module")
def local_run(model_dir, tmp_path_factory) -> Path:
    """The same extract on local disk: the reference every store run is compared with."""
    out = tmp_path_factory.mktemp("local") / "out"
    result = CliRunner().invoke(app, extract_args(model_dir, str(out)))
    assert result.exit_code == 0, result.output
    return out


def assert_same_output(ref, out) -> None:
    a, b = hsx.open(ref), hsx.open(out)
    assert len(a) == 40 and b.sample_ids == a.sample_ids
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids), x.sample_id
        for name in a.columns:
            assert torch.equal(bits(x.hidden(name)), bits(y.hidden(name))), (x.sample_id, name)


def test_extract_into_the_store_equals_local_disk_and_reads_back_everywhere(s3_env, model_dir, local_run, tmp_path):
    out = uri(s3_env, "extract")
    result = CliRunner().invoke(app, extract_args(model_dir, out))
    assert result.exit_code == 0, result.output
    m = load_manifest(out)
    assert m.complete and m.num_samples == 40
    assert_same_output(local_run, out)
    assert visible_parquet(s3_env, "extract") == {s.file for s in m.shards}
    stored = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="extract/")["Contents"]
    assert LEASE not in {k["Key"].rsplit("/", 1)[-1] for k in stored}, "a finished run releases its lease"
    for k in stored:  # credentials are in no object of the output
        body = s3_env.client().get_object(Bucket=s3_env.bucket, Key=k["Key"])["Body"].read()
        assert s3_env.secret_key.encode() not in body and s3_env.access_key.encode() not in body, k["Key"]

    import pandas as pd

    options = {"client_kwargs": {"endpoint_url": s3_env.endpoint}}
    df = pd.read_parquet(out + "/", columns=["sample_id", "input_ids"], storage_options=options)
    assert sorted(df["sample_id"]) == sorted(hsx.open(local_run).sample_ids)
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("parquet", data_files=out + "/*.parquet", storage_options=options,
                               cache_dir=str(tmp_path / "hf"), split="train")
    assert sorted(ds["sample_id"]) == sorted(df["sample_id"])

    checked = CliRunner().invoke(app, ["verify", out])
    assert checked.exit_code == 0 and "verify: OK" in checked.output, checked.output

    again = CliRunner().invoke(app, extract_args(model_dir, out))  # the same command: all resumed
    assert again.exit_code == 0, again.output
    assert load_manifest(out).shards == m.shards


# --------------------------------------------------------------------------- one writer

HOLD_AFTER_LEASE = """
import sys, threading
import hsx.storage.lease as lease
lease.LEASE_SECONDS = float(sys.argv[1])
import hsx.run.pipeline as pipeline
def prepare_output(*args, **kwargs):
    print("held", flush=True)
    threading.Event().wait()
pipeline.prepare_output = prepare_output
from hsx.cli import main
sys.argv = ["hsx", *sys.argv[2:]]
main()
"""

# Holds (on the shard writer's thread) once the manifest commits a shard, until a line comes on stdin.
HOLD_AFTER_COMMIT = """
import sys
import hsx.storage.lease as lease
lease.LEASE_SECONDS = float(sys.argv[1])
from hsx.shards import sink
real, held = sink.ShardSink._save, []
def save(self):
    real(self)
    if self.manifest.shards and not held:
        held.append(1)
        print("held", flush=True)
        sys.stdin.readline()
sink.ShardSink._save = save
from hsx.cli import main
sys.argv = ["hsx", *sys.argv[2:]]
main()
"""


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def start_held(hold: str, ttl_s: float, args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", hold, str(ttl_s), *args], env=child_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "held":
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run ended before it held (stdout {line!r}):\n{err[-3000:]}")
    return proc


def wait_until_expired(out: str) -> dict:
    """Poll the lease until the store's clock says it is expired (the holder is dead: it only ages)."""
    path = as_path(out) / LEASE
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        raw, _, age = path.store.get_with_age(path.key)
        holder = json.loads(raw)
        if age >= holder["ttl_s"]:
            return holder
        time.sleep(0.2)
    pytest.fail(f"the lease on {out} did not expire within {HANG_GUARD_S:.0f} s")


def test_a_second_writer_is_refused_naming_the_lease_holder(s3_env, model_dir):
    out = uri(s3_env, "second-writer")
    first = start_held(HOLD_AFTER_LEASE, 60, extract_args(model_dir, out))
    try:
        result = CliRunner().invoke(app, extract_args(model_dir, out))
        assert isinstance(result.exception, HsxError), result.output
        message = str(result.exception)
        print(f"second writer refused: {message}")
        assert f"pid {first.pid}" in message and "being written by another hsx run" in message
        holder = json.loads((as_path(out) / LEASE).read_text())
        assert holder["holder"] in message and holder["host"] in message
    finally:
        first.kill()
        first.communicate()


def test_the_expired_lease_of_a_crashed_writer_is_taken_over(s3_env, model_dir, local_run, caplog):
    out = uri(s3_env, "crashed-writer")
    crashed = start_held(HOLD_AFTER_LEASE, 1, extract_args(model_dir, out))
    crashed.send_signal(signal.SIGKILL)
    crashed.communicate()
    assert wait_until_expired(out)["pid"] == crashed.pid
    with caplog.at_level("WARNING", logger="hsx"):
        result = CliRunner().invoke(app, extract_args(model_dir, out))
    assert result.exit_code == 0, result.output
    assert f"pid {crashed.pid}" in caplog.text and "took over the lease" in caplog.text
    assert_same_output(local_run, out)


def test_a_live_lease_is_not_taken_and_a_lost_one_stops_commits(s3_env):
    """Two Lease objects (two runs): the second is refused while the first lives; a run whose lease
    was replaced refuses to commit."""
    out = as_path(uri(s3_env, "lease-api"))
    first = Lease(out).acquire()
    try:
        with pytest.raises(HsxError, match=first.me["holder"]):
            Lease(out).acquire()
        out.store.put(first.path.key, b'{"holder": "someone else", "ttl_s": 60}')  # replaced behind its back
        first.renew()
        with pytest.raises(HsxError, match="no longer holds the output's lease"):
            (out / MANIFEST).commit_bytes(b"{}")
    finally:
        first.release()
    assert json.loads((out / LEASE).read_text())["holder"] == "someone else", "a lost lease is not deleted"


def test_of_two_successors_to_an_expired_lease_one_takes_it(s3_env, monkeypatch):
    """Both read the expired lease; the one whose conditional put comes second is refused."""
    from hsx.storage.store import ObjectPath

    first, second = ObjectStore(s3_env.bucket), ObjectStore(s3_env.bucket)
    first.put(f"race/{LEASE}", json.dumps({"holder": "dead", "pid": 1, "host": "gone", "ttl_s": 0}).encode())
    winner = Lease(ObjectPath(second, "race"))
    read = first.get_with_age

    def read_then_the_other_takes_over(key):
        got = read(key)
        winner.acquire()
        return got

    monkeypatch.setattr(first, "get_with_age", read_then_the_other_takes_over)
    try:
        with pytest.raises(HsxError, match="took over the expired lease first"):
            Lease(ObjectPath(first, "race")).acquire()
        assert winner.taken_over["holder"] == "dead"
        assert json.loads(second.get(f"race/{LEASE}"))["holder"] == winner.me["holder"]
    finally:
        winner.release()


# --------------------------------------------------------------------------- the store stopped mid-run

def test_the_store_stopped_mid_run_then_restarted_resumes_to_the_uninterrupted_output(model_dir, local_run,
                                                                                      tmp_path, monkeypatch):
    server = S3Server(tmp_path / "store").start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        out = uri(server, "stopped")
        args = extract_args(model_dir, out)
        proc = start_held(HOLD_AFTER_COMMIT, 2, args)
        before = load_manifest(out)
        assert before.shards and not before.complete
        server.stop()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 2, stderr
        error = stderr.strip().splitlines()[-1]
        print(f"store stopped mid-run: {error}")
        assert server.endpoint in error and f"s3://{server.bucket}/stopped/" in error, error
        # the first request after the stop is a lane's upload or the manifest's save, whichever comes first
        assert re.search(r"while uploading shard shard-\d{5}|could not save the manifest .* committing shard\(s\) "
                         r"shard-\d{5}", error) and "stay committed" in error, error
        assert "Traceback" not in stderr, stderr

        server.start()
        after = load_manifest(out)
        assert after.shards[:len(before.shards)] == before.shards, "nothing committed is lost"
        assert visible_parquet(server, "stopped") == {s.file for s in after.shards}
        wait_until_expired(out)  # the stopped run could not release its lease
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert load_manifest(out).complete
        assert_same_output(local_run, out)
    finally:
        server.stop()


# --------------------------------------------------------------------------- --ray

def test_ray_workers_upload_their_shards_and_the_driver_commits(s3_env, model_dir, local_run):
    pytest.importorskip("ray")
    out = uri(s3_env, "ray")
    result = CliRunner().invoke(app, extract_args(model_dir, out, "--ray", "--ray-address", "local", "--num-workers",
                                                  "2", "--cpus-per-worker", "0.5", "--unit-size", "8",
                                                  "--window", "8"))
    assert result.exit_code == 0, result.output
    m = load_manifest(out)
    assert m.complete and all(s.file.startswith("shard-") for s in m.shards)
    assert visible_parquet(s3_env, "ray") == {s.file for s in m.shards}
    assert_same_output(local_run, out)


def test_a_ray_worker_killed_while_uploading_has_its_unit_rerun_each_sample_once(s3_env, model_dir, local_run, tmp_path):
    ray = pytest.importorskip("ray")
    out = uri(s3_env, "ray-killed")
    hold = tmp_path / "held"
    tests = str(Path(__file__).resolve().parent)
    env = {**s3_env.env(), "HSX_TEST_HOLD": str(hold), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([tests, str(ROOT), os.environ.get("PYTHONPATH", "")])}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env, "worker_process_setup_hook": "hold_upload.hold_first_upload"})
    result: dict = {}
    try:
        def run():
            try:
                result["summary"] = extract(
                    ExtractConfig(model=model_dir, dataset=str(PROMPTS), output=out, id_field="id",
                                             mode="prefill", batch_size=1, max_shard_samples=4, ray=True, num_workers=2,
                                             cpus_per_worker=0.5, unit_size=8, window=8), progress=False)
            except BaseException as e:  # reported below
                result["error"] = e

        driver = threading.Thread(target=run)
        driver.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not hold.exists() and driver.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hold.exists(), f"no upload was held ({result.get('error')!r})"
        time.sleep(0.2)  # the holder has written its line
        pid, key = hold.read_text().split()
        os.kill(int(pid), signal.SIGKILL)
        print(f"killed worker {pid} while it uploaded {key}")
        driver.join(timeout=5 * HANG_GUARD_S)
        assert not driver.is_alive(), "the run did not finish after its worker was killed"
    finally:
        ray.shutdown()
    assert "error" not in result, result.get("error")
    assert result["summary"].retried >= 1, "the killed worker's unit was not retried"
    m = load_manifest(out)
    ids = [i for s in m.shards for i in s.sample_ids]
    assert m.complete and len(ids) == len(set(ids)) == 40  # each sample once
    assert visible_parquet(s3_env, "ray-killed") == {s.file for s in m.shards}
    assert_same_output(local_run, out)
