"""Format version 6 against older versions: pandas, pyarrow and datasets read shards and output directories,
v1 and v3 outputs still read, rows stay read-only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import xxhash

import hsx
from hsx.errors import ShardError
from hsx.shards import load_manifest
from hsx.shards.format import FORMAT_VERSION, METADATA_CHECKSUM_KEY, METADATA_KEY
from hsx.shards.manifest import LEGACY_MANIFEST, MANIFEST, file_checksum
from hsx.shards import Manifest, ShardSink
from hsx.shards.verify import verify
from shard_fixtures import bits, finite_records, make_metadata, random_records, write_sink

torch.set_num_threads(1)


def _with_metadata(table: pa.Table, meta: dict) -> pa.Table:
    blob = json.dumps(meta, sort_keys=True).encode()
    return table.replace_schema_metadata({METADATA_KEY: blob, METADATA_CHECKSUM_KEY: xxhash.xxh3_64_hexdigest(blob)})


def as_version_1(src: Path, dst: Path) -> None:
    """Rewrite a version 2 shard the way version 1 stored it: ``list<fixed_size_binary(row_bytes)>``."""
    table = pq.read_table(src)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    meta = {**{k: v for k, v in meta.items() if k not in ("keep", "codec")}, "format_version": 1}
    table = table.drop_columns(["positions"])
    for g in meta["layers"]:
        col = table.column(g["name"])
        kind = pa.list_(pa.binary(g["row_bytes"]))
        chunks = [pa.ListArray.from_arrays(c.offsets, c.values.cast(pa.binary()).cast(pa.binary(g["row_bytes"])))
                  for c in col.chunks]
        field = pa.field(g["name"], kind, nullable=False)
        table = table.set_column(table.schema.get_field_index(g["name"]), field, pa.chunked_array(chunks, type=kind))
    pq.write_table(_with_metadata(table, meta), dst, write_page_checksum=True)


def test_pandas_reads_a_whole_shard_and_the_cells_are_the_rows(tmp_path):
    import pandas as pd

    meta = make_metadata([6, 3], "bfloat16", codec="none")
    records = finite_records(meta, [5, 1, 7, 4], seed=3)
    write_sink(tmp_path, meta, records)
    df = pd.read_parquet(tmp_path / "shard-00000.parquet")
    assert df["sample_id"].tolist() == [r.sample_id for r in records]
    for r, cell in zip(records, df["l0"]):
        # one bytes object per row; joined, they are the [rows, W] matrix of the stored dtype
        raw = np.frombuffer(b"".join(cell), dtype=np.int16).reshape(len(cell), 6) if len(cell) else np.zeros((0, 6), np.int16)
        assert np.array_equal(raw, bits(r.hidden["l0"]).numpy())


@pytest.mark.parametrize("codec", ["planes-zstd", "zstd", "none"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_hsx_decode_gives_the_stored_bits_from_pandas_and_pyarrow_cells(tmp_path, dtype, codec):
    import pandas as pd

    meta = make_metadata([6, 3], dtype, codec=codec)
    records = random_records(meta, [5, 1, 0, 7, 4], accept="none", seed=11)  # NaN payloads, -0.0, subnormals
    write_sink(tmp_path, meta, records, max_shard_samples=10)
    df = pd.read_parquet(tmp_path / "shard-00000.parquet")
    table = pq.read_table(tmp_path / "shard-00000.parquet")
    for k, r in enumerate(records):
        for name, width in (("l0", 6), ("l1", 3)):
            want = bits(r.hidden[name]).numpy()
            for cell in (df[name][k], table.column(name)[k].as_py()):
                got = hsx.decode(cell, width, dtype, codec)
                assert got.shape == want.shape and np.array_equal(got.view(want.dtype), want)
        assert df["positions"][k].tolist() == list(range(r.num_rows))


def test_version_1_shards_still_read_bit_exact(tmp_path):
    meta = make_metadata([6, 3], "float16", "prefill", codec="none")
    records = finite_records(meta, [5, 2, 7], seed=4)
    write_sink(tmp_path / "v2", meta, records)
    old = tmp_path / "v1"
    old.mkdir()
    as_version_1(tmp_path / "v2" / "shard-00000.parquet", old / "shard-00000.parquet")
    assert pq.read_schema(old / "shard-00000.parquet").field("l0").type == pa.list_(pa.binary(12))

    # a single file (page CRCs) and a directory (whole-file checksum in a version 1 manifest)
    m = load_manifest(tmp_path / "v2")
    m.metadata = json.loads(pq.read_schema(old / "shard-00000.parquet").metadata[METADATA_KEY])
    entry = m.shards[0]
    entry.bytes, entry.xxh3_128 = (old / entry.file).stat().st_size, file_checksum(old / entry.file)
    (old / MANIFEST).write_text(json.dumps(m.to_json()))  # a manifest of version 1, as format 1 wrote it
    for ds in (hsx.open(old / "shard-00000.parquet"), hsx.open(old)):
        assert ds.metadata["format_version"] == 1
        for r, s in zip(records, ds):
            assert torch.equal(bits(s.hidden("l1")), bits(r.hidden["l1"]))
            assert torch.equal(s.positions, torch.arange(r.num_rows))
        tm = ds.tokens("l0")
        assert torch.equal(bits(tm.hidden), bits(torch.cat([r.hidden["l0"] for r in records])))
    assert FORMAT_VERSION == 8


def test_samples_come_back_in_source_order_whatever_order_they_were_written(tmp_path):
    # an engine hands samples back as they finish: the manifest (format 3) lists each one's source index
    meta = make_metadata([4], "float32", "prefill")
    records = finite_records(meta, [3, 6, 2, 5, 4], seed=1)
    written = [records[i] for i in (3, 0, 4, 1, 2)]
    m = write_sink(tmp_path / "out", meta, written, max_shard_samples=2)
    assert [e.source_indices for e in m.shards] == [[1003, 1000], [1004, 1001], [1002]]
    ds = hsx.open(tmp_path / "out")
    assert [s.source_index for s in ds] == [1000, 1001, 1002, 1003, 1004]
    assert ds.sample_ids == [r.sample_id for r in records]
    for r, s in zip(records, ds):
        assert torch.equal(bits(s.hidden("l0")), bits(r.hidden["l0"]))
    tm = ds.tokens("l0")  # rows name their sample by its index in this (source) order
    for i, r in enumerate(records):
        assert torch.equal(bits(tm.hidden[tm.sample_index == i]), bits(r.hidden["l0"]))
    loader = hsx.tokens_loader(tmp_path / "out", batch_size=64)
    got = {int(i): n for i, n in zip(*np.unique(np.concatenate([b["sample_index"].numpy() for b in loader]), return_counts=True))}
    assert got == {i: r.num_rows for i, r in enumerate(records)}
    assert ds.table()["source_index"].to_pylist() == [1000, 1001, 1002, 1003, 1004]

    # a format-2 manifest lists no source indices: manifest order, as written
    raw = load_manifest(tmp_path / "out").to_json()  # the layout of a manifest before format 7
    for e in raw["shards"]:
        del e["source_indices"]
    (tmp_path / "out" / MANIFEST).write_text(json.dumps(raw))
    assert [s.source_index for s in hsx.open(tmp_path / "out")] == [1003, 1000, 1004, 1001, 1002]


def test_a_row_of_the_wrong_length_is_a_shard_error_naming_the_file(tmp_path):
    meta = make_metadata([4], "bfloat16", codec="none")
    write_sink(tmp_path / "out", meta, finite_records(meta, [3, 4]))
    table = pq.read_table(tmp_path / "out" / "shard-00000.parquet")
    col = table.column("l0").combine_chunks()
    values = col.values.to_pylist()
    values[2] = values[2] + b"\x00\x00"  # one row two bytes too long
    kind = pa.list_(pa.large_binary())
    bad = pa.ListArray.from_arrays(col.offsets, pa.array(values, pa.large_binary()))
    table = table.set_column(table.schema.get_field_index("l0"), pa.field("l0", kind, nullable=False), bad)
    f = tmp_path / "bad.parquet"
    pq.write_table(table, f)
    with pytest.raises(ShardError, match=r"bad.parquet.*'l0' has a 10-byte row.*8 bytes per row"):
        hsx.open(f)


def test_hidden_views_refuse_writes_and_reads_stay_unchanged(tmp_path):
    meta = make_metadata([4], "bfloat16")
    records = finite_records(meta, [5, 6], seed=5)
    write_sink(tmp_path, meta, records)
    ds = hsx.open(tmp_path)
    h = ds[0].hidden("l0")
    writes = {
        "in-place op": lambda: h.add_(1),
        "item assignment": lambda: h.__setitem__(0, 0.0),
        "a view's in-place op": lambda: h[1:].zero_(),
        "augmented assignment": lambda: h.__imul__(2),
        "out=": lambda: torch.mul(h, 2, out=h),
        "numpy view": lambda: h.view(torch.int16).numpy().__setitem__(0, 1),
        "tokens() view": lambda: ds.tokens("l0").hidden.fill_(0),
    }
    for what, write in writes.items():
        with pytest.raises(ValueError, match="read-only"):
            write()
    assert torch.equal(bits(ds[0].hidden("l0")), bits(records[0].hidden["l0"]))
    copy = h.clone()
    copy.add_(1)  # a copy is an ordinary tensor
    assert type(copy) is torch.Tensor and type(h.float() * 2) is torch.Tensor


def as_version_3(d: Path) -> None:
    """Rewrite a version 4 output the way version 3 stored it: rows layout, no positions, ``manifest.json``."""
    m = load_manifest(d)
    m.metadata = {**{k: v for k, v in m.metadata.items() if k != "codec"}, "format_version": 3}
    for e in m.shards:
        table = pq.read_table(d / e.file).drop_columns(["positions"])
        pq.write_table(_with_metadata(table, m.metadata), d / e.file, write_page_checksum=True,
                       column_encoding={f"{g['name']}.list.element": "DELTA_LENGTH_BYTE_ARRAY" for g in m.metadata["layers"]},
                       use_dictionary=False)
        e.bytes, e.xxh3_128 = (d / e.file).stat().st_size, file_checksum(d / e.file)
    (d / MANIFEST).unlink()
    (d / LEGACY_MANIFEST).write_text(json.dumps(m.to_json()))


def test_version_3_outputs_still_read_bit_exact(tmp_path):
    meta = make_metadata([5], "bfloat16", "prefill", codec="none")
    records = finite_records(meta, [4, 2, 6], seed=9)
    write_sink(tmp_path / "old", meta, records, max_shard_samples=2)
    as_version_3(tmp_path / "old")
    ds = hsx.open(tmp_path / "old")
    assert ds.metadata["format_version"] == 3 and len(ds) == 3
    for r, s in zip(records, ds):
        assert torch.equal(bits(s.hidden("l0")), bits(r.hidden["l0"]))
    assert torch.equal(bits(ds.tokens("l0").hidden), bits(torch.cat([r.hidden["l0"] for r in records])))
    assert sum(b["l0"].shape[0] for b in hsx.tokens_loader(tmp_path / "old", batch_size=4)) == sum(r.num_rows for r in records)
    assert hsx.open(tmp_path / "old" / "shard-00000.parquet")[0].sample_id == records[0].sample_id


def _plain_readers(d: Path) -> dict[str, list[str]]:
    """The sample ids each plain reader finds in the directory ``d``."""
    import datasets
    import pandas as pd
    import pyarrow.dataset as pads

    return {
        "pandas": sorted(pd.read_parquet(d)["sample_id"]),
        "pyarrow": sorted(pads.dataset(d, format="parquet").to_table(columns=["sample_id"]).column(0).to_pylist()),
        "datasets": sorted(datasets.load_dataset("parquet", data_dir=str(d), split="train")["sample_id"]),
    }


@pytest.mark.parametrize("keep", ["all", "loss"])
def test_plain_readers_read_the_output_directory_and_only_committed_shards(tmp_path, keep, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))

    meta = {**make_metadata([4], "bfloat16", "generate"), "keep": keep}
    records = finite_records(meta, [5, 3, 6, 4, 7], seed=2)
    if keep != "all":  # rows of the kept positions only
        from hsx.shards.positions import sample_positions
        for r in records:
            pos = sample_positions(keep, "generate", len(r.input_ids), r.prompt_len, r.loss_mask.numpy())
            r.hidden = {"l0": r.hidden["l0"][torch.from_numpy(pos)]}
    d = tmp_path / "out"
    sink = ShardSink(d, Manifest(meta), max_shard_samples=2)
    for r in records[:4]:
        sink.add(r)  # two shards committed (2 + 2 samples)
    sink.add(records[4])
    sink._flush_row_group()  # a row group on disk, not committed: a crash here leaves it staged
    committed = sorted(r.sample_id for r in records[:4])
    # a Ray attempt that never committed, and a temp file of a crashed write
    (d / ".shard-000009-deadbeef0000-00.parquet.part").write_bytes((d / "shard-00000.parquet").read_bytes())
    assert {k: v for k, v in _plain_readers(d).items()} == {"pandas": committed, "pyarrow": committed, "datasets": committed}
    sink.commit()
    everything = sorted(r.sample_id for r in records)
    assert _plain_readers(d) == {"pandas": everything, "pyarrow": everything, "datasets": everything}
    import pandas as pd
    df = pd.read_parquet(d).set_index("sample_id")
    for r, s in zip(records, hsx.open(d)):
        assert df.loc[r.sample_id, "positions"].tolist() == s.positions.tolist()
        assert np.array_equal(hsx.decode(df.loc[r.sample_id, "l0"], 4), bits(r.hidden["l0"]).numpy().view(np.uint16))


def test_a_shard_committed_but_not_yet_renamed_is_read_and_renamed_by_the_next_sink(tmp_path):
    meta = make_metadata([4], "bfloat16", "prefill")
    records = finite_records(meta, [3, 5, 2, 4], seed=6)
    d = tmp_path / "out"
    m = write_sink(d, meta, records, max_shard_samples=2)
    # a crash between the manifest's save and the rename: the committed shard is still staged
    (d / "shard-00001.parquet").rename(d / ".shard-00001.parquet.part")
    ds = hsx.open(d)
    assert ds.sample_ids == [r.sample_id for r in records]
    for r, s in zip(records, ds):
        assert torch.equal(bits(s.hidden("l0")), bits(r.hidden["l0"]))
    assert verify(d).ok
    assert sorted(_plain_readers(d)["pyarrow"]) == sorted(r.sample_id for r in records[:2])  # not yet visible
    ShardSink(d, load_manifest(d)).close()  # the next run's sink renames it first
    assert (d / "shard-00001.parquet").exists() and not (d / ".shard-00001.parquet.part").exists()
    assert _plain_readers(d)["pandas"] == sorted(r.sample_id for r in records)
    assert [e.file for e in load_manifest(d).shards] == [e.file for e in m.shards]
