"""The manifest in memory: each shard entry's sample ids and source indices are packed (a buffer and an
array, not Python lists), read as the lists they replace; the set of done ids is one sorted array that
answers as a set does; the ids repeated across entries are found by one sort. A manifest of 20,000
samples read back and its done ids take a few tens of bytes a sample, not the ~150 of Python objects."""

from __future__ import annotations

import pickle
import random
import tracemalloc

import pytest

from hsx.shards import Manifest, ShardEntry, load_manifest
from hsx.shards.manifest import save_manifest
from hsx.shards.packed import IdSet, PackedInts, PackedStrings, repeats
from shard_fixtures import make_metadata

ID_GRID = {
    "short": [f"train:{i}" for i in range(50)],
    "unicode and empty": ["", "é", "日本語", "a b", "train:1", "x"],
    "one long among short": ["s" * 300] + [f"r{i}" for i in range(40)],
    "nul-ended": ["a", "a\0", "b\0\0", "c"],
    "lone surrogate": ["a", "\ud800", "b\udfffc"],  # not UTF-8, but a Python str a dataset may hold
}


@pytest.mark.parametrize("ids", ID_GRID.values(), ids=ID_GRID.keys())
def test_packed_strings_read_as_the_list_they_hold(ids):
    p = PackedStrings(ids)
    assert p == ids and list(p) == ids and len(p) == len(ids) and p[-1] == ids[-1] and p[1:3] == ids[1:3]
    assert p != ids[:-1] and p != [*ids[:-1], "other"]
    assert pickle.loads(pickle.dumps(p)) == p


def test_packed_ints_read_as_the_list_they_hold():
    for values in ([], [3, 1, 2], [2**40, -5]):
        p = PackedInts(values)
        assert p == values and list(p) == values and pickle.loads(pickle.dumps(p)) == values
    assert PackedInts([1, 2]).array.itemsize == 4 and PackedInts([2**40]).array.itemsize == 8


@pytest.mark.parametrize("ids", ID_GRID.values(), ids=ID_GRID.keys())
def test_id_set_answers_as_a_set(ids):
    rng = random.Random(0)
    half = len(ids) // 2
    done = IdSet([PackedStrings(ids[:half]), PackedStrings(ids[half - 1:])])  # one id in both lists
    assert done == set(ids) and len(done) == len(set(ids)) and sorted(done) == sorted(set(ids))
    for sid in ids:
        assert sid in done
    for absent in ("never", ids[0] + "!", ids[-1] + "\0", "\0"):
        assert (absent in done) == (absent in set(ids))
    done.update([ids[0], "new-1"], ["new-2"])
    assert len(done) == len(set(ids)) + 2 and "new-1" in done and "new-2" in done
    probe = rng.sample(ids, min(5, len(ids))) + ["new-2", "absent"]
    assert done.intersection(probe) == (set(ids) | {"new-1", "new-2"}).intersection(probe)


@pytest.mark.parametrize("ids", ID_GRID.values(), ids=ID_GRID.keys())
def test_repeats_are_the_ids_an_earlier_list_holds(ids):
    rng = random.Random(1)
    lists = [rng.sample(ids, rng.randrange(1, len(ids) + 1)) for _ in range(6)]
    lists[2] = lists[2] + lists[2][:1]  # a repeat inside one list alone is not one an earlier list holds
    want, seen = {}, set()
    for k, ids_k in enumerate(lists):
        if dup := seen.intersection(ids_k):
            want[k] = sorted(dup)
        seen.update(ids_k)
    assert repeats([PackedStrings(x) for x in lists]) == want


def _commits(out, shards: int, per_shard: int) -> Manifest:
    out.mkdir(parents=True, exist_ok=True)
    m = Manifest(make_metadata([4], mode="prefill"), config_hash="test")
    save_manifest(out, m)
    for k in range(shards):
        first = k * per_shard
        m.shards.append(ShardEntry(f"shard-{k:05d}.parquet", per_shard, per_shard, per_shard, 1000, "0" * 32,
                                   [f"train:{i}" for i in range(first, first + per_shard)],
                                   list(range(first, first + per_shard))))
        save_manifest(out, m)
    return m


def test_a_manifest_read_back_holds_its_lists_packed_and_equal(tmp_path):
    written = _commits(tmp_path / "out", 300, 4)  # a fold at 256 records: segments and records both read
    m = load_manifest(tmp_path / "out")
    assert m.shards == written.shards and m.shards[7].sample_ids == ["train:28", "train:29", "train:30", "train:31"]
    assert isinstance(m.shards[0].sample_ids, PackedStrings) and isinstance(m.shards[0].source_indices, PackedInts)
    assert m.done_ids() == {f"train:{i}" for i in range(1200)}


def test_a_manifest_and_its_done_ids_take_tens_of_bytes_a_sample(tmp_path):
    """20,000 samples in 200 entries: the manifest read back and its done ids, ids like ``train:12345``."""
    n = 20_000
    _commits(tmp_path / "out", 200, n // 200)
    tracemalloc.start()
    try:
        m = load_manifest(tmp_path / "out")
        done = m.done_ids()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(done) == n and m.num_samples == n
    # Python lists of str and int held ~113 bytes a sample and the set of done ids ~34 more
    assert held / n < 50, f"{held / n:.0f} bytes a sample held"
    assert peak / n < 80, f"{peak / n:.0f} bytes a sample at the peak"


def test_verify_names_the_ids_an_earlier_shard_holds(tmp_path):
    """Shard 2 repeats both ids of shard 1, shard 3 one id of its own twice: verify names the two ids in
    shard 2's faults and nothing for shard 3 (a repeat inside one shard is not an earlier shard's)."""
    import dataclasses

    from hsx.shards import ShardSink
    from hsx.shards.verify import verify
    from shard_fixtures import finite_records

    meta = make_metadata([4], mode="prefill")
    records = finite_records(meta, [3] * 6)
    ids = ["a", "b", "b", "a", "c", "c"]  # shards of two: {a, b}, {b, a}, {c, c}
    records = [dataclasses.replace(r, sample_id=sid) for r, sid in zip(records, ids)]
    sink = ShardSink(tmp_path / "out", Manifest(meta), max_shard_samples=2)
    for r in records:
        sink.add(r)
    sink.close()
    faults = [s.faults for s in verify(tmp_path / "out").shards]
    assert faults == [[], ["sample ids also in an earlier shard: ['a', 'b']"], []]
