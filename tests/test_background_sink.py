"""BackgroundSink: the same bytes as ShardSink, bounded memory, writer errors surfaced, drained on close;
and records whose rows are still being copied are waited for before they are read."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import hsx
from hsx.align import AlignedSample, Collector, LayerGroup, teacher_forced
from hsx.errors import ShardError
from hsx.shards import BackgroundSink, Manifest, ShardSink, ShardWriter, load_manifest
from hsx.shards.cells import Cells
from hsx.shards.verify import verify
from shard_fixtures import bits, finite_records, make_metadata, random_records

ERRORS = [("bad-0", 70, "empty text"), ("bad-1", 71, "too long"), ("bad-2", 72, "duplicate")]


def feed(sink, records) -> Manifest:
    """The same calls for either sink: errors between adds, a commit half way, close at the end."""
    for k, r in enumerate(records):
        sink.add(r)
        if k % 4 == 1:
            sink.add_error(*ERRORS[k % 3])
        if k == len(records) // 2:
            sink.commit()
    return sink.close()


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hsx-shard-writer:")]


@pytest.mark.parametrize("options", [
    {},
    {"row_group_bytes": 1, "max_shard_samples": 3, "max_pending_bytes": 1},  # a row group per record, blocking on each
    {"row_group_bytes": 700, "max_shard_bytes": 3000, "max_pending_bytes": 2000},
    {"row_group_bytes": 700, "max_shard_bytes": 3000, "max_pending_bytes": 2000, "lanes": 3},
])
def test_output_is_byte_identical_to_shard_sink(tmp_path, options):
    meta = make_metadata([8, 4], mode="generate")
    records = random_records(meta, [3, 9, 1, 17, 5, 2, 12, 7, 4, 6, 11], accept="mixed", seed=3)
    sync_options = {k: v for k, v in options.items() if k != "max_pending_bytes"}
    expected = feed(ShardSink(tmp_path / "sync", Manifest(meta), **sync_options), records)
    got = feed(BackgroundSink(tmp_path / "bg", Manifest(meta), **{"lanes": 1, **options}), records)
    assert got.to_json() == expected.to_json()
    assert got.complete and len(got.shards) == len(expected.shards) and len(got.errors) == 3
    assert files(tmp_path / "bg") == files(tmp_path / "sync")  # shards and manifest, byte for byte


@pytest.fixture
def slow_writes(monkeypatch):
    """ShardWriter.write slowed down; returns the bytes of the records each finished write held."""
    written: list[int] = []
    real = ShardWriter.write

    def write(self, records):
        time.sleep(0.02)
        real(self, records)
        written.extend(r.nbytes() for r in records)

    monkeypatch.setattr(ShardWriter, "write", write)
    return written


def test_add_blocks_while_the_queued_bytes_exceed_the_bound(tmp_path, slow_writes):
    meta = make_metadata([64])
    records = finite_records(meta, [33] * 20, seed=1)
    big = finite_records(meta, [400], seed=2)[0]
    size = records[0].nbytes()
    bound = 3 * size
    # one lane: a lane holds its row group in flight beyond the bound (BackgroundSink's docstring)
    sink = BackgroundSink(tmp_path, Manifest(meta), row_group_bytes=1, max_pending_bytes=bound, lanes=1)
    added, outstanding = 0, []
    for r in records[:10] + [big] + records[10:]:
        sink.add(r)
        added += r.nbytes()
        outstanding.append(added - sum(slow_writes))  # queued or being written, seen from the caller
    m = sink.close()
    assert max(outstanding) <= max(bound, big.nbytes())
    assert max(outstanding[:10]) <= bound  # without the bound all ten would be queued at once
    assert sink.stats.peak_pending_bytes <= big.nbytes() and big.nbytes() > bound
    assert sink.stats.blocked_s > 0.1  # 21 writes of 20 ms, a queue of 3
    assert sink.stats.busy_s >= 21 * 0.02
    assert m.num_samples == 21 and sink.pending_bytes == 0


@pytest.mark.parametrize("observer", ["add", "add_error", "commit", "close"])
def test_a_writer_error_surfaces_in_the_next_call_and_keeps_what_was_committed(tmp_path, monkeypatch, observer):
    meta = make_metadata([8])
    records = finite_records(meta, [5] * 8, seed=5)
    sink = BackgroundSink(tmp_path, Manifest(meta), row_group_bytes=1)
    for r in records[:3]:
        sink.add(r)
    sink.add_error(*ERRORS[0])
    sink.commit()
    committed = files(tmp_path)

    def full(self, batch):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardWriter, "write", full)
    sink.add(records[3])  # fails on the writer thread
    sink.add_error(*ERRORS[1])  # queued behind the failure: dropped
    for t in writer_threads():
        t.join(5)  # the writer stops at its first failure
    assert not writer_threads()

    calls = {"add": lambda: sink.add(records[4]), "add_error": lambda: sink.add_error(*ERRORS[2]),
             "commit": sink.commit, "close": sink.close}
    with pytest.raises(ShardError, match="No space left on device") as e:
        calls[observer]()
    assert str(tmp_path) in str(e.value) and isinstance(e.value.__cause__.__cause__, OSError)
    with pytest.raises(ShardError, match="No space left"):
        sink.close()  # and again: close never completes a failed output
    with pytest.raises(ShardError):
        sink.close(complete=False)

    assert not sink.manifest.complete
    on_disk = load_manifest(tmp_path)
    assert not on_disk.complete and on_disk.done_ids() == {"s000", "s001", "s002", "bad-0"}
    assert {n: b for n, b in files(tmp_path).items() if ".tmp-" not in n} == committed  # nothing written after
    assert verify(tmp_path).ok
    assert hsx.open(tmp_path).sample_ids == ["s000", "s001", "s002"]


def test_a_failure_in_the_final_commit_is_raised_by_close_and_leaves_the_output_incomplete(tmp_path, monkeypatch):
    meta = make_metadata([8])
    records = finite_records(meta, [5] * 4, seed=6)
    sink = BackgroundSink(tmp_path, Manifest(meta))
    for r in records[:2]:
        sink.add(r)
    sink.commit()
    for r in records[2:]:
        sink.add(r)
    monkeypatch.setattr("hsx.shards.sink.save_manifest", lambda d, m: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(ShardError, match="I/O error"):
        sink.close(complete=True)
    assert not sink.manifest.complete
    on_disk = load_manifest(tmp_path)
    assert not on_disk.complete and on_disk.done_ids() == {"s000", "s001"}


@pytest.fixture
def gated_writes(monkeypatch):
    """ShardWriter.write held until the test opens the gate; returns (gate, records written)."""
    gate, written = threading.Event(), []
    real = ShardWriter.write

    def write(self, records):
        gate.wait()
        real(self, records)
        written.extend(records)

    monkeypatch.setattr(ShardWriter, "write", write)
    return gate, written


def test_close_incomplete_drains_the_queue_and_stops_the_thread(tmp_path, gated_writes):
    gate, written = gated_writes
    meta = make_metadata([16])
    records = finite_records(meta, [9] * 12, seed=7)
    sink = BackgroundSink(tmp_path, Manifest(meta), row_group_bytes=1, max_pending_bytes=1 << 30)
    assert all(t.daemon for t in writer_threads()) and writer_threads()
    for r in records:
        sink.add(r)
    sink.add_error(*ERRORS[0])
    assert written == []  # every write still held when close is called (an interrupted run)
    gate.set()
    m = sink.close(complete=False)
    assert not writer_threads()
    assert len(written) == len(records)
    on_disk = load_manifest(tmp_path)
    assert not on_disk.complete and on_disk.to_json() == m.to_json()
    assert on_disk.done_ids() == {r.sample_id for r in records} | {"bad-0"}
    before = files(tmp_path)
    assert sink.close(complete=False) is m and files(tmp_path) == before  # a second close writes nothing
    with pytest.raises(ShardError, match="closed"):
        sink.add(records[0])


def test_commit_returns_once_the_records_are_durable(tmp_path, slow_writes):
    meta = make_metadata([16])
    records = finite_records(meta, [9] * 6, seed=8)
    with BackgroundSink(tmp_path, Manifest(meta), row_group_bytes=1, max_pending_bytes=1 << 30) as sink:
        for r in records:
            sink.add(r)
        sink.commit()
        assert load_manifest(tmp_path).done_ids() == {r.sample_id for r in records}
    assert load_manifest(tmp_path).complete


class InFlightCopy:
    """Stands in for a torch.cuda.Event: the rows hold garbage until ``synchronize`` "completes the copy"."""

    def __init__(self, log: list, sample_id: str, hidden: dict, values: dict):
        self.log, self.sample_id, self.hidden, self.values = log, sample_id, hidden, values

    def synchronize(self) -> None:
        self.log.append(("wait", self.sample_id, threading.current_thread().name))
        for name, h in self.hidden.items():
            h.copy_(self.values[name])


@pytest.mark.parametrize("sink_class", [ShardSink, BackgroundSink])
def test_records_are_waited_for_before_their_rows_are_read(tmp_path, monkeypatch, sink_class):
    meta = make_metadata([8, 4])
    records = finite_records(meta, [4, 6, 3, 5], seed=9)
    log: list = []
    expected = {}
    for r in records:
        expected[r.sample_id] = {n: h.clone() for n, h in r.hidden.items()}
        for h in r.hidden.values():
            h.fill_(float("nan"))
        r.ready = InFlightCopy(log, r.sample_id, r.hidden, expected[r.sample_id])
    owner = {id(h): r.sample_id for r in records for h in r.hidden.values()}
    real = Cells.encode

    def encode(self, parts):
        log.append(("encode", [owner[id(p)] for p in parts], threading.current_thread().name))
        return real(self, parts)

    monkeypatch.setattr(Cells, "encode", encode)
    sink = sink_class(tmp_path, Manifest(meta), row_group_bytes=200)
    for r in records:
        sink.add(r)
    sink.close()

    waits = [e for e in log if e[0] == "wait"]
    # every record is waited for exactly once; the lanes wait in parallel, so only one thread (the
    # synchronous sink's caller) waits in record order
    if sink_class is ShardSink:
        assert [e[1] for e in waits] == [r.sample_id for r in records]
    else:
        assert sorted(e[1] for e in waits) == sorted(r.sample_id for r in records)
    encodes = [k for k, e in enumerate(log) if e[0] == "encode"]
    assert len(encodes) > 2  # several row groups
    for k in encodes:  # each row group is encoded only after all of its records were waited for
        assert set(log[k][1]) <= {e[1] for e in log[:k] if e[0] == "wait"}
    engine_thread = threading.current_thread().name
    assert all((w[2] != engine_thread) == (sink_class is BackgroundSink) for w in waits)
    if sink_class is BackgroundSink:  # row groups are encoded on the lanes' threads, in parallel
        assert {log[k][2] for k in encodes} == {f"hsx-shard-lane{j}_0" for j in range(min(len(encodes), sink.lanes))}
    for s in hsx.open(tmp_path):
        for name, h in expected[s.sample_id].items():
            assert torch.equal(bits(s.hidden(name)), bits(h))


def test_cpu_samples_carry_no_event_and_wait_is_a_no_op():
    groups = [LayerGroup("l0", (1,), 4)]
    sample = teacher_forced(torch.arange(3), {"l0": torch.randn(3, 4)}, groups, torch.bfloat16)
    assert sample.ready is None
    sample.wait()
    c = Collector(groups, torch.bfloat16)
    c.prefill("r", torch.arange(2), {"l0": torch.randn(2, 4)}, first_token=5)
    c.extend("r", {"l0": torch.randn(1, 4)}, torch.tensor([6]))
    assert c.finish("r", 2, "length", speculative=False).ready is None

    calls = []

    class Event:
        def synchronize(self):
            calls.append(1)

    AlignedSample(torch.arange(2), 1, {}, ready=Event()).wait()
    assert calls == [1]


@pytest.mark.parametrize("lanes", [2, 3])
def test_lanes_hold_the_same_samples_as_one_lane(tmp_path, lanes):
    meta = make_metadata([8, 4], mode="prefill")
    records = random_records(meta, [3, 9, 1, 17, 5, 2, 12, 7, 4, 6, 11], accept="mixed", seed=5)
    one = feed(BackgroundSink(tmp_path / "one", Manifest(meta), lanes=1, row_group_bytes=300, max_shard_bytes=2000), records)
    many = feed(BackgroundSink(tmp_path / "many", Manifest(meta), lanes=lanes, row_group_bytes=300, max_shard_bytes=2000),
                records)
    assert len({e.file for e in many.shards}) == len(many.shards) and len(many.shards) >= lanes
    a, b = hsx.open(tmp_path / "one"), hsx.open(tmp_path / "many")
    assert a.sample_ids == b.sample_ids == [r.sample_id for r in records]  # source order, whatever the lanes did
    for x, y in zip(a, b):
        for name in a.columns:
            assert torch.equal(bits(x.hidden(name)), bits(y.hidden(name)))
    assert sorted(e.sample_id for e in b.errors) == sorted(e.sample_id for e in a.errors)
