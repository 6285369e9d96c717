"""Bounded reads of long samples: full reads decode piece by piece into one tensor, partial reads and the
loader hold about one piece, the exports stream pieces; every path gives the bits a whole read gives.

Memory is checked through Arrow's own accounting (a proxy pool per step: the largest amount of Arrow
memory held at once, above what the step started with), which, unlike the resident set, is exact and
the same on every machine; scripts/long_sample_memory.py measures the resident peak."""

from __future__ import annotations

import gc

import io
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import hsx
from hsx.errors import ShardError
from hsx.export import export_saelens, export_speculators
from hsx.shards import format as fmt
from hsx.shards import loader as loader_mod
from hsx.shards.reader import open_shards
from hsx.shards.shard import Shard
from hsx.shards.verify import verify
from shard_fixtures import bits, finite_records, make_metadata, random_records, write_sink

LOSSLESS = ["bfloat16", "float16", "float32"]
CODECS = ["planes-zstd", "zstd", "none"]
TOKENS = [41, 3, 1, 26, 2, 17]  # a long sample first and last, a no-row sample, short ones between
WIDTHS = [5, 12]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def piece_bytes(meta: dict, rows: int) -> int:
    return rows * max(fmt.row_bytes(g["width"], meta["dtype"]) for g in meta["layers"])


def records_for(meta: dict, tokens=TOKENS, seed: int = 0):
    if meta["dtype"] in fmt.LOSSY:
        return finite_records({**meta, "dtype": "float32"}, tokens, seed)
    return random_records(meta, tokens, "mixed", seed)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def pieces_per_sample(path: Path) -> list[int]:
    first = np.concatenate([pq.read_table(f, columns=["first_row"]).column("first_row").to_numpy()
                            for f in sorted(path.glob("shard-*.parquet"))])
    starts = np.append(np.flatnonzero(first == 0), len(first))
    return np.diff(starts).tolist()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", LOSSLESS + list(fmt.LOSSY))
def test_a_samples_pieces_chain_to_the_sample_and_none_is_kept(tmp_path, codec, dtype):
    meta = make_metadata(WIDTHS, dtype, "prefill", codec)
    write_sink(tmp_path / "out", meta, records_for(meta), piece_bytes=piece_bytes(meta, 4), max_shard_samples=4)
    whole = [{c: s.hidden(c).clone() for c in s.hidden} for s in hsx.open(tmp_path / "out")]
    counts = pieces_per_sample(tmp_path / "out")
    assert max(counts) >= 5
    ds = hsx.open(tmp_path / "out")
    for j, s in enumerate(ds):
        for c in ds.columns:
            got = list(s.hidden.pieces(c))
            assert len(got) == counts[j], (s.sample_id, c)
            assert same_bits(torch.cat(got), whole[j][c]), (s.sample_id, c)
            if counts[j] > 1:
                assert all(p.shape[0] <= 4 for p in got)
                full = s.hidden(c)  # decoded piece by piece into one tensor
                assert same_bits(full, whole[j][c]) and full.untyped_storage().nbytes() == full.numel() * full.element_size()
                with pytest.raises(ValueError, match="read-only"):
                    full.add_(1)
    long_groups = set()
    for shard in ds._cache.values():
        starts = shard._span
        for row in np.flatnonzero(np.diff(starts) > 1):
            long_groups |= {(shard.path, int(g)) for g in shard._group_of[starts[row]:starts[row + 1]]}
        kept = {(shard.path, g) for _, g in [*shard._blocks, *shard._chunks]}
        assert not kept & long_groups  # a long sample's pieces are decoded and let go, never kept


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", LOSSLESS + list(fmt.LOSSY))
def test_decode_of_chained_cells_gives_the_sample(tmp_path, codec, dtype):
    meta = make_metadata(WIDTHS, dtype, "generate", codec)
    write_sink(tmp_path / "out", meta, records_for(meta, seed=4), piece_bytes=piece_bytes(meta, 5))
    ds = hsx.open(tmp_path / "out")
    (f,) = sorted((tmp_path / "out").glob("shard-*.parquet"))
    table = pq.read_table(f)
    ids, first = table.column("sample_id").to_pylist(), table.column("first_row").to_pylist()
    for s in ds:
        for g in meta["layers"]:
            rows = sorted((first[k], k) for k in range(len(ids)) if ids[k] == s.sample_id)
            cells = [table.column(g["name"])[k].as_py() for _, k in rows]
            got = hsx.decode([v for c in cells for v in c], g["width"], dtype, codec)
            h = s.hidden(g["name"])
            want = h.float().numpy() if dtype in fmt.LOSSY else h.contiguous().view(bits(h).dtype).numpy().view(got.dtype)
            assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8)), (s.sample_id, g)
    if dtype in fmt.LOSSY and codec == "planes-zstd":
        with pytest.raises(ShardError, match="holds 3 a piece"):
            hsx.decode([], WIDTHS[0], dtype, codec)


_PROXIES = []  # kept for good: a buffer allocated through a proxy pool frees into it, whenever that is


@contextmanager
def arrow_peak():
    """The largest Arrow memory held at once inside the block, above what was held when it began (bytes)."""
    parent = pa.default_memory_pool()
    proxy = pa.proxy_memory_pool(parent)
    _PROXIES.append(proxy)
    gc.collect()  # no garbage of earlier work freed inside the block, whenever a collection would come
    gc.disable()  # and none collected in it: what the block frees, it frees by reference counts alone
    # one Arrow thread: columns decoded in parallel (the shard's small columns are) overlap by the
    # scheduler's whim, and the peak with them; one at a time it is the same on every run
    threads = pa.cpu_count()
    pa.set_cpu_count(1)
    pa.set_memory_pool(proxy)
    got = {}
    try:
        yield got
    finally:
        pa.set_memory_pool(parent)
        pa.set_cpu_count(threads)
        gc.enable()
        got["peak"] = proxy.max_memory()


@pytest.fixture(scope="module")
def long_sample(tmp_path_factory) -> tuple[Path, dict, int]:
    """One sample of 48 pieces of 96 KiB in its widest column, planes-zstd (6 MiB of states in all)."""
    d = tmp_path_factory.mktemp("long") / "out"
    meta = make_metadata([512, 1536], "bfloat16", "generate")
    # as an EAGLE3 run stores them: the final norm's output, and boundaries 1, 2 and 4 (of 4 blocks) side by side
    meta["layers"] = [{**meta["layers"][0], "name": "final", "sources": ["final"]},
                      {**meta["layers"][1], "name": "eagle3", "sources": [1, 2, 4]}]
    piece = piece_bytes(meta, 32)
    write_sink(d, meta, finite_records(meta, [32 * 48 + 1], seed=3), piece_bytes=piece)
    assert pieces_per_sample(d) == [48]
    return d, meta, piece


def test_arrow_memory_of_reads_of_a_long_sample_is_about_one_piece(long_sample):
    d, meta, piece = long_sample
    with arrow_peak() as opened:
        ds = hsx.open(d)
        s = ds[0]  # the shard checked and its small columns read (each piece repeats the sample's tokens)
        n = s.num_rows
    with arrow_peak() as full:
        kept = [s.hidden(c) for c in ds.columns]
    with arrow_peak() as part:
        kept += [s.hidden(c, rows=slice(a, a + 100)) for c in ds.columns for a in (0, n // 3, n - 100)]
    with arrow_peak() as tokens:
        kept += [ds.tokens(c).hidden for c in ds.columns]
    with arrow_peak() as loader:
        assert sum(b["position"].numel() for b in hsx.tokens_loader(d, batch_size=64, shuffle_buffer=0)) == n
    stored = n * sum(fmt.row_bytes(g["width"], "bfloat16") for g in meta["layers"])
    assert stored == 64 * piece
    # one piece's compressed page, decompressed page and Arrow values, with room to spare; the reader
    # before read all 64 pieces' worth of states when the shard was opened
    tokens_bytes = 48 * 5 * (n + 1)  # input_ids and loss_mask, in every piece: read with their pages
    assert opened["peak"] < 6 * tokens_bytes + 2 * piece, opened["peak"] / piece
    for what, got in {"full": full, "part": part, "tokens": tokens}.items():
        assert got["peak"] < 5 * piece, (what, got["peak"] / piece)
    assert loader["peak"] < 5 * piece + 3 * 5 * (n + 1), loader["peak"] / piece


def test_the_exports_read_a_long_sample_a_piece_at_a_time(long_sample, tmp_path, monkeypatch):
    d, meta, _ = long_sample
    reads = {"whole": 0}
    hidden = Shard.hidden

    def counted(self, name, row):
        reads["whole"] += int(self._span[row + 1] - self._span[row] > 1)
        return hidden(self, name, row)

    monkeypatch.setattr(Shard, "hidden", counted)
    export_speculators(d, tmp_path / "spec", target_layer_ids=[1, 2], progress=False)
    export_saelens(d, tmp_path / "sae", column="b4", context_size=64, progress=False)
    assert reads["whole"] == 0  # never the whole long sample at once


def test_the_safetensors_writer_gives_the_bytes_safetensors_gives():
    from safetensors.torch import save

    from hsx.export.speculators import write_safetensors

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for t, k in [(2, 1), (3, 3), (1001, 4)]:
            ids = torch.arange(t, dtype=torch.int64) * 31
            states = torch.randn(t, k, 5).to(dtype)
            f = io.BytesIO()
            write_safetensors(f, {"token_ids": ids, "hidden_states": states})
            assert f.getvalue() == save({"token_ids": ids, "hidden_states": states}), (dtype, t, k)


def test_the_batcher_cuts_the_stream_as_one_concatenation_would():
    rng = np.random.default_rng(0)
    parts = [int(x) for x in rng.integers(0, 3000, 40)]
    stream = [{"position": np.arange(n) + 10_000 * k, "x": rng.integers(0, 255, (n, 3), dtype=np.uint8)}
              for k, n in enumerate(parts)]
    batcher = loader_mod._Batcher(1024)
    got = [b for p in stream for b in batcher.add(p)]
    last = batcher.flush()
    got += [last] if last is not None else []
    whole = {k: np.concatenate([p[k] for p in stream]) for k in stream[0]}
    assert [len(b["position"]) for b in got[:-1]] == [1024] * (len(got) - 1)
    for k in whole:
        assert np.array_equal(np.concatenate([b[k] for b in got]), whole[k])
    for b in got:  # a batch cut out of a larger part is a copy: keeping it does not keep the part
        assert b["x"].base is None or b["x"].base.size == b["x"].size


@pytest.mark.parametrize("batch", [20, 50])  # batches cut out of a piece, and batches spanning two
def test_the_loaders_batches_of_a_long_sample_own_their_memory(long_sample, batch):
    d, _, piece = long_sample
    for b in hsx.tokens_loader(d, batch_size=batch, shuffle_buffer=0):
        for c in ("final", "eagle3"):
            t = b[c]  # a batch kept keeps its own rows, not the piece they were cut from
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (c, t.untyped_storage().nbytes())


def test_a_bounded_block_cache_reads_the_same_bits(tmp_path):
    meta = make_metadata(WIDTHS, "bfloat16", "generate")
    records = records_for(meta, [5, 7, 3, 9, 4, 6, 8, 2], seed=1)
    write_sink(tmp_path / "out", meta, records, row_group_bytes=300)
    ds = open_shards(tmp_path / "out", cache_blocks=1)
    for r, s in zip(records, ds):
        for c in ds.columns:
            assert same_bits(s.hidden(c), r.hidden[c])
            assert same_bits(s.hidden(c, rows=slice(1, 3)), r.hidden[c][1:3])
    (shard,) = ds._cache.values()
    assert len(shard._group_start) > 3
    for c in ds.columns:  # one row group of each column kept, decoded, and one read for partial reads
        assert sum(k[0] == c for k in shard._blocks) == 1 and sum(k[0] == c for k in shard._chunks) <= 1


def test_a_piece_whose_cells_disagree_with_its_positions_is_refused(tmp_path):
    meta = make_metadata(WIDTHS, "bfloat16", "prefill", "none")
    write_sink(tmp_path / "out", meta, records_for(meta), piece_bytes=piece_bytes(meta, 4))
    (f,) = sorted((tmp_path / "out").glob("shard-*.parquet"))
    table = pq.read_table(f)
    first = table.column("first_row").to_numpy()
    k = int(np.flatnonzero(first > 0)[0])  # a later piece of the first long sample
    cells = table.column("l0").to_pylist()
    cells[k] = cells[k][:-1]  # one row short; its positions and the pieces after it unchanged
    bad = table.set_column(table.schema.get_field_index("l0"), table.schema.field("l0"),
                           pa.array(cells, table.schema.field("l0").type))
    lone = tmp_path / "lone.parquet"
    pq.write_table(bad, lone, row_group_size=1)
    with pytest.raises(ShardError, match=r"lone.parquet.*a piece of 3 rows of column 'l0', its positions column lists 4"):
        hsx.open(lone)


def test_verify_reads_a_long_sample_a_row_group_at_a_time(long_sample):
    d, meta, piece = long_sample
    with arrow_peak() as checked:
        report = verify(d)
    assert report.ok and report.samples == 1, report
    assert report.shards[0].rows == hsx.open(d)[0].num_rows
    n = report.shards[0].rows
    # the shard's small columns (as hsx.open reads them) and about one piece; verify before held the shard
    # whole (64 pieces' worth of states, read and decoded) while checking it
    tokens_bytes = 48 * 5 * (n + 1)
    assert checked["peak"] < 6 * tokens_bytes + 5 * piece, checked["peak"] / piece


@pytest.mark.parametrize("codec", CODECS)
def test_verify_names_the_sample_and_position_of_a_nan_in_a_later_piece(tmp_path, codec):
    meta = make_metadata(WIDTHS, "bfloat16", "prefill", codec)
    records = finite_records(meta, TOKENS, seed=2)
    records[0].hidden["l1"][30, 3] = float("nan")  # the first long sample's 8th piece of 4 rows
    records[-1].hidden["l1"][2, 0] = float("inf")
    write_sink(tmp_path / "whole", meta, records)
    write_sink(tmp_path / "pieces", meta, records, piece_bytes=piece_bytes(meta, 4), max_shard_samples=4)
    assert max(pieces_per_sample(tmp_path / "pieces")) >= 8
    said = {}
    for name in ("whole", "pieces"):
        report = verify(tmp_path / name)
        said[name] = [f for s in report.shards for f in s.faults]
    first = f"with NaN/Inf (first in sample {records[0].sample_id!r}, position 30)"
    assert said["whole"] == [f"column 'l1': 2 rows {first}"], said  # one shard
    last = f"column 'l1': 1 rows with NaN/Inf (first in sample {records[-1].sample_id!r}, position 2)"
    assert said["pieces"] == [f"column 'l1': 1 rows {first}", last], said  # the second shard of pieces


def test_verify_reports_a_piece_that_holds_a_neighbours_row(tmp_path):
    meta = make_metadata(WIDTHS, "bfloat16", "prefill", "none")
    write_sink(tmp_path / "out", meta, finite_records(meta, TOKENS), piece_bytes=piece_bytes(meta, 4))
    (f,) = sorted((tmp_path / "out").glob("shard-*.parquet"))
    table = pq.read_table(f)
    first = table.column("first_row").to_numpy()
    k = int(np.flatnonzero(first > 0)[0])  # a later piece of the first long sample, and the piece after it
    cells = table.column("l0").to_pylist()
    cells[k + 1] = cells[k][-1:] + cells[k + 1]  # a row moved to the next piece: the sample's rows in all unchanged
    cells[k] = cells[k][:-1]
    bad = table.set_column(table.schema.get_field_index("l0"), table.schema.field("l0"),
                           pa.array(cells, table.schema.field("l0").type))
    lone = tmp_path / "lone.parquet"
    pq.write_table(bad, lone, row_group_size=1)
    report = verify(lone)
    faults = report.shards[0].faults
    assert faults == [f"sample {table.column('sample_id')[k].as_py()!r}: a piece holds 3 rows of 'l0', "
                      "its positions column lists 4"], faults
    assert verify(tmp_path / "out").ok
