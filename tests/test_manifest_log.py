"""The manifest at scale: a commit writes what it commits (a log record, folded into segments), however
many shards the output already holds; a writer killed with SIGKILL at any point resumes to an output
equal to an uninterrupted one, locally and in an object store; shards fan out into folders; an output of
the previous layout (the whole manifest in one JSON file) is read, verified and resumed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import hsx
from hsx.shards import Manifest, ShardSink, load_manifest
from hsx.shards import commitlog, sink as sink_module
from hsx.shards.manifest import MANIFEST, manifest_path, save_manifest
from hsx.shards.verify import verify
from s3_server import s3_env, s3_server  # noqa: F401  (fixtures)
from shard_fixtures import bits, finite_records, make_metadata, make_record

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def tiny_record(i: int, meta: dict):
    """Sample ``i`` of a deterministic stream: 2 to 4 tokens, its rows drawn from a generator seeded by ``i``."""
    n = 2 + i % 3
    gen = torch.Generator().manual_seed(i)
    hidden = {g["name"]: torch.randn(n, g["width"], generator=gen).to(torch.bfloat16) for g in meta["layers"]}
    return make_record(i, n, meta, hidden, None)


def manifest_files(d: Path) -> dict[str, bytes]:
    """Every file of the output but the shards: what a commit of the manifest writes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*")
            if p.is_file() and not p.name.endswith((".parquet", ".part"))}


def test_a_commits_bytes_do_not_grow_with_the_samples_already_committed(tmp_path):
    """1,280 one-sample shards, each its own commit: the manifest bytes written by the last 256 commits (one
    fold among them) are those of commits 256-511 (when the whole manifest was rewritten at every commit,
    ~3x as much by then)."""
    meta = make_metadata([4], mode="prefill")
    d = tmp_path / "out"
    sink = ShardSink(d, Manifest(meta), max_shard_samples=1)
    written, before = [], manifest_files(d)
    for i in range(1280):
        sink.add(tiny_record(i, meta))  # a full shard: committed now
        after = manifest_files(d)
        written.append(sum(len(v) for k, v in after.items() if before.get(k) != v))
        before = after
    sink.close()
    window = commitlog.COMPACT_EVERY
    early, late = written[window:2 * window], written[-window:]
    assert sum(late) <= 1.1 * sum(early), (sum(early), sum(late))
    assert max(late) <= 1.1 * max(early)  # the fold's commit, the largest, too
    assert len(hsx.open(d)) == 1280 and verify(d).ok


def test_the_log_folds_into_segments_and_reads_back_the_same_manifest(tmp_path):
    meta = make_metadata([4], mode="prefill")
    d = tmp_path / "out"
    m = Manifest(meta)
    d.mkdir()
    save_manifest(d, m)  # as a run starts: the head, nothing committed
    sink = ShardSink(d, m, max_shard_samples=1)
    for i in range(commitlog.COMPACT_EVERY * 2 + 5):
        sink.add(tiny_record(i, meta))
        if i % 7 == 0:
            sink.add_error(f"bad{i}", 5000 + i, "test error")
    m = sink.close()
    on_disk = load_manifest(d)
    assert on_disk.to_json() == m.to_json() and on_disk.complete
    head = json.loads((d / MANIFEST).read_text())
    assert head["version"] == commitlog.MANIFEST_VERSION and len(head["segments"]) == 2
    records = sorted(p.name for p in (d / commitlog.LOG_DIR).glob("log-*.json"))
    assert len(records) == len(m.shards) + 1 - 2 * commitlog.COMPACT_EVERY  # the unfolded ones (and the close)
    assert "shards" not in head  # entries live in segments and records only


@pytest.mark.parametrize("resume_at", [None, 40, commitlog.COMPACT_EVERY + 3])
def test_records_and_segments_hold_each_entrys_json(tmp_path, resume_at):
    """A record is ``json.dumps`` of its body and a segment of the entries it folds (compact separators),
    whether the fold joins the texts its own records wrote or, after a resume with records unfolded,
    encodes them again; ids outside ASCII and error records among them."""
    meta = make_metadata([4], mode="prefill")
    d = tmp_path / "out"
    m = Manifest(meta)
    d.mkdir()
    save_manifest(d, m)
    sink = ShardSink(d, m, max_shard_samples=1)
    for i in range(commitlog.COMPACT_EVERY * 2 + 5):
        if i == resume_at:  # a new writer on what is on disk: records since the last fold it did not write
            sink.close()
            sink = ShardSink(d, load_manifest(d), max_shard_samples=1)
        record = tiny_record(i, meta)
        if i % 5 == 0:
            record.sample_id = f"é{i}✓"
        sink.add(record)
        if i % 7 == 0:
            sink.add_error(f"bad{i}ü", 5000 + i, "test error ✗")
    m = sink.close()
    compact = {"separators": (",", ":")}
    shards, errors = [s.to_json() for s in m.shards], [asdict(e) for e in m.errors]
    head = json.loads((d / MANIFEST).read_text())
    at_shard = at_error = 0
    for seg in head["segments"]:
        body = {"shards": shards[at_shard:at_shard + seg["shards"]], "errors": errors[at_error:at_error + seg["errors"]]}
        assert (d / commitlog.LOG_DIR / seg["file"]).read_bytes() == json.dumps(body, **compact).encode(), seg
        at_shard, at_error = at_shard + seg["shards"], at_error + seg["errors"]
    assert len(head["segments"]) == 2 and at_shard == commitlog.COMPACT_EVERY * 2 - (resume_at is not None)
    for path in sorted((d / commitlog.LOG_DIR).glob("log-*.json")):
        body = json.loads(path.read_bytes())
        assert path.read_bytes() == json.dumps(body, **compact).encode()
        at_shard += len(body["shards"])
    assert at_shard == len(shards) and load_manifest(d).to_json() == m.to_json() and verify(d).ok


def test_a_segment_rewritten_after_its_commit_is_an_error_naming_it(tmp_path):
    meta = make_metadata([4], mode="prefill")
    d = tmp_path / "out"
    sink = ShardSink(d, Manifest(meta), max_shard_samples=1)
    for i in range(commitlog.COMPACT_EVERY + 1):
        sink.add(tiny_record(i, meta))
    sink.close()
    segment = d / commitlog.LOG_DIR / "segment-000000.json"
    segment.write_bytes(segment.read_bytes().replace(b"s000", b"s999"))
    with pytest.raises(hsx.ShardError, match="segment-000000.json: checksum"):
        hsx.open(d)
    assert not verify(d).ok


def test_a_second_writer_of_the_same_record_is_refused(tmp_path):
    meta = make_metadata([4], mode="prefill")
    d = tmp_path / "out"
    write = ShardSink(d, Manifest(meta), max_shard_samples=1)
    write.add(tiny_record(0, meta))
    other = ShardSink(d, load_manifest(d), max_shard_samples=1)  # a second writer the lock would have stopped
    other.add(tiny_record(1, meta))
    with pytest.raises(hsx.HsxError, match="another writer"):
        write.add(tiny_record(2, meta))
    assert load_manifest(d).shards[-1].sample_ids == ["s001"]


def test_shards_fan_out_into_folders_that_every_reader_finds(tmp_path, monkeypatch):
    monkeypatch.setattr(sink_module, "SHARDS_PER_FOLDER", 4)
    meta = make_metadata([4], mode="prefill")
    d = tmp_path / "out"
    records = [tiny_record(i, meta) for i in range(22)]
    sink = ShardSink(d, Manifest(meta), max_shard_samples=2)
    for r in records[:12]:
        sink.add(r)
    sink.close()
    sink = ShardSink(d, load_manifest(d), max_shard_samples=2)  # a resumed run numbers on
    for r in records[12:]:
        sink.add(r)
    m = sink.close()
    assert [e.file for e in m.shards][3:6] == ["shard-00003.parquet", "part-0001/shard-00004.parquet",
                                               "part-0001/shard-00005.parquet"]
    assert m.shards[-1].file == "part-0002/shard-00010.parquet"
    assert max(len(list(p.glob("*.parquet"))) for p in [d, *d.glob("part-*")]) == 4
    ds = hsx.open(d)
    assert ds.sample_ids == [r.sample_id for r in records]
    for r, s in zip(records, ds):
        assert torch.equal(bits(s.hidden("l0")), bits(r.hidden["l0"]))
    report = verify(d)
    assert report.ok and report.ignored == []
    (d / "part-0002" / ".shard-00099.parquet.part").write_bytes(b"a crashed write")
    assert verify(d).ignored == ["part-0002/.shard-00099.parquet.part"]
    import pyarrow.dataset as pads
    found = pads.dataset(d, format="parquet").to_table(columns=["sample_id"]).column(0).to_pylist()
    assert sorted(found) == sorted(r.sample_id for r in records)  # plain readers walk the folders


def test_an_output_with_the_manifest_in_one_file_is_read_and_resumed(tmp_path):
    """The layout before format 7: the whole manifest in ``.hsx-manifest.json``, no log. The new code reads it,
    verifies it, and a resumed sink rewrites it once as a head and a segment, then appends records."""
    meta = make_metadata([4, 2], mode="generate")
    records = finite_records(meta, [3, 5, 2, 6, 4, 3, 7], seed=4)
    d = tmp_path / "old"
    sink = ShardSink(d, Manifest({**meta, "format_version": 6}), max_shard_samples=2)
    for r in records[:5]:
        sink.add(r)
    sink.add_error("broken", 77, "bad input")
    m = sink.close(complete=False)
    for p in (d / commitlog.LOG_DIR).iterdir():  # as format 6 left it: one file, every entry in it
        p.unlink()
    (d / commitlog.LOG_DIR).rmdir()
    (d / MANIFEST).write_text(json.dumps(m.to_json(), indent=1))
    assert "shards" in json.loads((d / MANIFEST).read_text())
    old = load_manifest(d)
    assert old.log is None and old.to_json() == m.to_json()
    ds = hsx.open(d)
    assert ds.sample_ids == [r.sample_id for r in records[:5]] and [e.sample_id for e in ds.errors] == ["broken"]
    assert verify(d).ok
    sink = ShardSink(d, old, max_shard_samples=2)
    for r in records[5:]:
        sink.add(r)
    sink.close()
    head = json.loads((d / MANIFEST).read_text())
    assert head["version"] == commitlog.MANIFEST_VERSION and "shards" not in head
    ds = hsx.open(d)
    assert ds.sample_ids == [r.sample_id for r in records]
    for r, s in zip(records, ds):
        assert torch.equal(bits(s.hidden("l1")), bits(r.hidden["l1"]))
    assert verify(d).ok


# --------------------------------------------------------------------------- kill -9 and resume

# A writer of samples 0..N-1 in order, resuming from the output's manifest (skipping the done ids); says
# "ready" once it has read the manifest, and is killed with SIGKILL by the test somewhere after that.
# It folds the log every FOLD_EVERY records, so that a test of seconds crosses several folds.
FOLD_EVERY = 16
WRITER = """
import sys
sys.path.insert(0, sys.argv[4])
import torch
torch.set_num_threads(1)
from hsx.shards import Manifest, ShardSink, commitlog, load_manifest
commitlog.COMPACT_EVERY = int(sys.argv[5])
from hsx.shards.manifest import manifest_path
from shard_fixtures import make_metadata
from test_manifest_log import tiny_record
out, n, per_shard, pause_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[6])
meta = make_metadata([4], mode="prefill")
m = load_manifest(out) if manifest_path(out).is_file() else Manifest(meta)
done = m.done_ids()
sink = ShardSink(out, m, max_shard_samples=per_shard)
print("ready", flush=True)
added = 0
for i in range(n):
    r = tiny_record(i, meta)
    if r.sample_id not in done:
        sink.add(r)
        added += 1
        if added == pause_at:  # wait here for the kill
            print("paused", flush=True)
            sys.stdin.readline()
sink.close()
"""


def run_writer(out: str, n: int, per_shard: int, kill_after: float | None, pause_at: int = 0) -> bool:
    """Run the writer; kill it ``kill_after`` seconds after it is ready, or once it has added ``pause_at``
    samples (it waits there, so the kill lands at that point whatever the machine's speed). True when it
    finished by itself."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, out, str(n), str(per_shard), str(ROOT / "tests"),
                             str(FOLD_EVERY), str(pause_at)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    if kill_after is not None:
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    elif pause_at:
        line = proc.stdout.readline().strip()
        if line == "paused":
            proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return proc.returncode == 0


def assert_equal_outputs(got: str, want: str) -> None:
    a, b = hsx.open(got), hsx.open(want)
    assert sorted(a.sample_ids) == sorted(set(a.sample_ids)) == sorted(b.sample_ids)  # each sample exactly once
    by_id = {s.sample_id: s for s in b}
    for s in a:
        assert torch.equal(bits(s.hidden("l0")), bits(by_id[s.sample_id].hidden("l0")))
        assert torch.equal(s.input_ids, by_id[s.sample_id].input_ids)
    assert verify(got).ok and load_manifest(got).complete


def kill_and_resume(out: str, reference: str, n: int, seed: int, longest: float) -> int:
    """Kill the writer at random points (up to ``longest`` seconds after it is ready) until it finishes;
    returns how many times it was killed."""
    rng, kills = random.Random(seed), 0
    while not run_writer(out, n, 3, rng.uniform(0.0, longest)):
        kills += 1
        assert kills < 50, "no progress: every run was killed before its first commit"
        if not manifest_path(out).is_file():
            continue  # killed before its first commit
        ids = [i for e in load_manifest(out).shards for i in e.sample_ids]
        assert len(ids) == len(set(ids))  # at every kill: what is committed, once
    assert_equal_outputs(out, reference)
    return kills


def test_a_writer_killed_at_random_points_resumes_to_the_uninterrupted_output(tmp_path):
    n = 3 * 5 * FOLD_EVERY  # five folds' worth of one-shard commits
    assert run_writer(str(tmp_path / "whole"), n, 3, None)
    kills = kill_and_resume(str(tmp_path / "killed"), str(tmp_path / "whole"), n, seed=1, longest=1.0)
    assert kills >= 1


def test_a_writer_killed_at_random_points_resumes_in_the_object_store(tmp_path, s3_env):
    """Killed after a random number of samples (it waits there for the kill: the store on loopback can be
    faster than any fixed delay), mid-shard or just after a commit, until it finishes."""
    n = 3 * 2 * FOLD_EVERY  # two folds' worth
    assert run_writer(str(tmp_path / "whole"), n, 3, None)
    out = f"s3://{s3_env.bucket}/killed-writer"
    rng, kills, left = random.Random(2), 0, n
    while left:
        pause_at = rng.randint(1, left) if kills < 5 else 0  # five kills, then run to the end
        if run_writer(out, n, 3, None, pause_at):
            break
        kills += 1
        if manifest_path(out).is_file():
            ids = [i for e in load_manifest(out).shards for i in e.sample_ids]
            assert len(ids) == len(set(ids))  # at every kill: what is committed, once
            left = n - len(ids)
    assert kills == 5
    assert_equal_outputs(out, str(tmp_path / "whole"))
