"""``hsx.tokens_loader``: every selected row once per epoch across workers and ranks, seeded shuffles
across sequences, labels that match ``ds.tokens()``, and memory that does not grow with the dataset."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import hsx
from hsx.errors import HsxError
from shard_fixtures import bits, finite_records, make_metadata, write_sink

torch.set_num_threads(1)
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """4 shards of 2-3 row groups each, samples of 1-40 tokens, two columns."""
    d = tmp_path_factory.mktemp("loader") / "out"
    meta = make_metadata([8, 4], "bfloat16", "generate")
    lengths = [int(x) for x in np.random.default_rng(0).integers(1, 40, 48)]
    write_sink(d, meta, finite_records(meta, lengths, seed=2), max_shard_samples=12, row_group_bytes=2500)
    return d


def collect(loader, workers: int = 0) -> dict[str, torch.Tensor]:
    batches = list(DataLoader(loader, batch_size=None, num_workers=workers))
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]} | {"_sizes": torch.tensor([len(b["position"]) for b in batches])}


def keys(si: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return si * 100_000 + pos


def reference(d: Path, name: str):
    ds = hsx.open(d)
    tm = ds.tokens(name)
    order = torch.argsort(keys(tm.sample_index, tm.position))
    return ds, tm, order


def test_two_workers_yield_every_row_once_with_its_labels(shards):
    ds, tm, _ = reference(shards, "l0")
    got = collect(hsx.tokens_loader(shards, columns=["l0", "l1"], batch_size=32, shuffle_buffer=200, seed=1), workers=2)
    k = keys(got["sample_index"], got["position"])
    assert k.numel() == tm.position.numel() and k.unique().numel() == k.numel()  # each row exactly once
    ref_k = keys(tm.sample_index, tm.position)
    where = torch.from_numpy(np.searchsorted(ref_k.numpy(), k.numpy()))  # tokens() is in (sample, position) order
    assert torch.equal(ref_k[where], k)
    assert torch.equal(bits(got["l0"]), bits(tm.hidden[where]))
    assert torch.equal(bits(got["l1"]), bits(ds.tokens("l1").hidden[where]))
    assert torch.equal(got["token_id"], tm.token_id[where])
    # next_token: the token after the row's position in its own sample
    ids = [s.input_ids.long() for s in ds]
    nxt = torch.tensor([int(ids[i][p + 1]) if p + 1 < len(ids[i]) else -1
                        for i, p in zip(got["sample_index"].tolist(), got["position"].tolist())])
    assert torch.equal(got["next_token"], nxt)
    assert (got["_sizes"][:-2] == 32).all()  # full batches; each worker's last one may be short


def test_order_depends_on_the_seed_and_epoch_and_mixes_sequences(shards):
    def order(seed, epoch=0, workers=2):
        loader = hsx.tokens_loader(shards, columns=["l1"], batch_size=16, shuffle_buffer=300, seed=seed)
        loader.set_epoch(epoch)
        got = collect(loader, workers)
        return keys(got["sample_index"], got["position"]), got

    a, got = order(0)
    b, _ = order(1)
    c, _ = order(0, epoch=1)
    again, _ = order(0)
    assert torch.equal(a, again)  # seeded: the same seed gives the same order
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.sort(a).values, torch.sort(b).values) and torch.equal(torch.sort(a).values, torch.sort(c).values)
    first = got["sample_index"][:16]
    assert first.unique().numel() >= 6, first  # one batch holds rows of many sequences
    plain = collect(hsx.tokens_loader(shards, columns=["l1"], batch_size=16, shuffle_buffer=0))
    k = keys(plain["sample_index"], plain["position"])
    assert torch.equal(k, torch.sort(k).values)  # no shuffle: storage order


@pytest.mark.parametrize("blocks", ["many", "fewer than consumers"])
def test_ranks_and_workers_split_the_rows_without_overlap(shards, tmp_path, blocks):
    d = shards
    if blocks != "many":  # one shard, one row group, 2 ranks x 2 workers
        d = tmp_path / "one"
        meta = make_metadata([8], "bfloat16", "prefill")
        write_sink(d, meta, finite_records(meta, [7, 9, 3, 12], seed=3))
    ds = hsx.open(d)
    total = ds.tokens(ds.columns[0]).position.numel()
    parts = []
    for rank in range(2):
        got = collect(hsx.tokens_loader(d, columns=ds.columns[:1], batch_size=8, shuffle_buffer=20, seed=5,
                                        rank=rank, world_size=2), workers=2)
        parts.append(keys(got["sample_index"], got["position"]))
    both = torch.cat(parts)
    assert both.numel() == total and both.unique().numel() == total
    assert all(p.numel() > 0 for p in parts)


@pytest.mark.parametrize("where", ["completion", "loss", "last"])
def test_where_selects_rows_by_position_rule(shards, where):
    ds, tm, _ = reference(shards, "l1")
    got = collect(hsx.tokens_loader(shards, columns=["l1"], where=where, batch_size=64, seed=2), workers=2)
    table = ds.table(["prompt_len", "loss_mask", "input_ids"])
    prompt = torch.tensor(table.column("prompt_len").to_pylist())
    n = torch.tensor([len(x) for x in table.column("input_ids").to_pylist()])
    masks = [torch.tensor(m) for m in table.column("loss_mask").to_pylist()]
    si, pos = tm.sample_index, tm.position
    if where == "completion":
        chosen = pos + 1 >= prompt[si]
    elif where == "last":
        chosen = pos == n[si] - 2
    else:
        chosen = torch.tensor([bool(masks[i][p + 1]) for i, p in zip(si.tolist(), pos.tolist())], dtype=torch.bool)
    want = torch.sort(keys(si[chosen], pos[chosen])).values
    assert want.numel() > 0
    assert torch.equal(torch.sort(keys(got["sample_index"], got["position"])).values, want)


def test_bad_arguments_are_refused(shards, tmp_path):
    with pytest.raises(HsxError, match=r"no hidden-state column\(s\) \['nope'\]"):
        hsx.tokens_loader(shards, columns=["nope"])
    with pytest.raises(HsxError, match="where must be one of"):
        hsx.tokens_loader(shards, where="middle")
    meta = make_metadata([4], mode="prefill")
    write_sink(tmp_path / "p", meta, finite_records(meta, [3]))
    with pytest.raises(HsxError, match="where completion needs generate mode"):
        hsx.tokens_loader(tmp_path / "p", where="completion")


def test_a_corrupt_shard_stops_the_loader_naming_the_file(shards, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(shards, d)
    f = d / "shard-00002.parquet"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(hsx.ShardError, match="shard-00002.parquet: checksum"):
        collect(hsx.tokens_loader(d, batch_size=64, seed=0))


def test_a_shard_left_under_its_staging_name_is_loaded_and_a_missing_one_named(shards, tmp_path):
    import shutil

    from hsx.shards.manifest import staged_name

    want = collect(hsx.tokens_loader(shards, batch_size=64, seed=0))
    d = tmp_path / "copy"
    shutil.copytree(shards, d)
    (d / "shard-00001.parquet").rename(d / staged_name("shard-00001.parquet"))  # a crash before the rename
    got = collect(hsx.tokens_loader(d, batch_size=64, seed=0))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(bits(got[k]), bits(want[k])) if want[k].is_floating_point() else torch.equal(got[k], want[k]), k
    (d / staged_name("shard-00001.parquet")).unlink()
    with pytest.raises(hsx.ShardError, match="shard-00001.parquet: shard listed in the manifest is missing"):
        hsx.tokens_loader(d, batch_size=64, seed=0)


PEAK = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import hsx
    from shard_fixtures import finite_records, make_metadata, write_sink
    d, samples, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    meta = make_metadata([512], "bfloat16", "prefill")
    if how == "write":
        from hsx.shards import Manifest, ShardSink
        sink = ShardSink(d, Manifest(meta), max_shard_samples=100, row_group_bytes=4 << 20)
        for start in range(0, samples, 20):
            for r in finite_records(meta, [200] * 20, seed=start):
                sink.add(r)
        sink.close()
        sys.exit(0)
    import hsx.shards.loader, pyarrow, pyarrow.parquet  # imports are not what is measured
    pyarrow.array([1]).to_numpy()  # pyarrow imports pandas on first use
    def peak_kb():  # this process's own peak (ru_maxrss would carry the forking parent's over exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    before = peak_kb()
    rows = 0
    if how == "loader":
        for b in hsx.tokens_loader(d, batch_size=1024, shuffle_buffer=8192, seed=0):
            rows += len(b["position"])
    else:
        rows = hsx.open(d).tokens("l0").hidden.shape[0]
    after = peak_kb()
    print(json.dumps({{"rows": rows, "growth_kb": after - before}}))
""")


def _peak(script: Path, d: Path, samples: int, how: str) -> dict:
    out = subprocess.run([sys.executable, str(script), str(d), str(samples), how], capture_output=True, text=True,
                         check=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1]) if how != "write" else {}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak memory is read from /proc/self/status")
def test_peak_memory_does_not_grow_with_the_dataset(tmp_path):
    script = tmp_path / "peak.py"
    script.write_text(PEAK.format(tests=str(TESTS)))
    small, big = tmp_path / "small", tmp_path / "big"
    _peak(script, small, 100, "write")  # 100 x 200 rows x 1 KiB = 20 MB
    _peak(script, big, 400, "write")  # 80 MB
    loader_small, loader_big = _peak(script, small, 0, "loader"), _peak(script, big, 0, "loader")
    tokens_big = _peak(script, big, 0, "tokens")
    assert loader_small["rows"] == 20_000 and loader_big["rows"] == tokens_big["rows"] == 80_000
    grown_mb = (loader_big["growth_kb"] - loader_small["growth_kb"]) / 1024
    # 60 MB more data: the loader's peak moves by a few MB at most; concatenating every row does not
    assert grown_mb < 10, (loader_small, loader_big)
    assert tokens_big["growth_kb"] / 1024 > 60, tokens_big
