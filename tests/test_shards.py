"""Shard format v1: what a written shard promises its readers.

Bit-exact round-trips over dtypes, widths, modes, compression and shard/row-group budgets;
zero-copy hidden-state views; corruption that is reported, never read as numbers; crash
safety of the sink; no code execution on read; metadata columns readable by other tools.
"""

from __future__ import annotations

import ast
import gc
import json
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.errors import ShardError
from hsx.shards import Manifest, ShardSink, ShardWriter, load_manifest
from hsx.shards.format import BASE_NAMES, FORMAT_VERSION, METADATA_CHECKSUM_KEY, METADATA_KEY
from hsx.shards.manifest import MANIFEST
from shard_fixtures import bits, finite_records, make_metadata, random_records, rows_for, write_sink

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- round-trip checks


def assert_sample(s, r) -> None:
    assert s.sample_id == r.sample_id
    assert s.source_index == r.source_index
    assert s.input_ids.dtype == torch.int32 and s.input_ids.tolist() == r.input_ids.tolist()
    assert s.prompt_len == r.prompt_len
    assert s.loss_mask.tolist() == r.loss_mask.tolist()
    assert s.finish_reason == r.finish_reason
    if r.accept_lens is None:
        assert s.accept_lens is None and s.verify_steps is None
    else:
        assert s.accept_lens is not None, s.sample_id
        assert s.accept_lens.tolist() == r.accept_lens.tolist()
        assert s.verify_steps == r.accept_lens.numel()
    assert s.num_rows == r.num_rows
    assert s.positions.tolist() == list(range(r.num_rows))
    for name, want in r.hidden.items():
        got = s.hidden(name)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (s.sample_id, name)
        assert torch.equal(bits(got), bits(want)), (s.sample_id, name)


def assert_tokens(tm, items, name: str, width: int, dtype: torch.dtype) -> None:
    """``items``: (dataset index, record) in the order their rows must appear."""
    parts = [r.hidden[name] for _, r in items]
    want = torch.cat(parts) if parts else torch.empty((0, width), dtype=dtype)
    assert tm.hidden.dtype == dtype and tuple(tm.hidden.shape) == tuple(want.shape)
    assert torch.equal(bits(tm.hidden), bits(want))
    rows = [r.num_rows for _, r in items]
    assert tm.sample_index.tolist() == [i for (i, _), n in zip(items, rows) for _ in range(n)]
    assert tm.position.tolist() == [p for n in rows for p in range(n)]
    assert tm.token_id.tolist() == [t for (_, r), n in zip(items, rows) for t in r.input_ids[:n].tolist()]
    assert tm.sample_index.dtype == tm.position.dtype == tm.token_id.dtype == torch.int64


def check_roundtrip(d: Path, meta: dict, records: list) -> None:
    names = [g["name"] for g in meta["layers"]]
    widths = {g["name"]: g["width"] for g in meta["layers"]}
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[meta["dtype"]]
    ids = [r.sample_id for r in records]
    manifest = load_manifest(d)
    assert manifest.metadata == meta and manifest.complete
    for entry in manifest.shards:
        assert json.loads(pq.read_schema(d / entry.file).metadata[METADATA_KEY]) == meta

    ds = hsx.open(d)
    assert ds.metadata == meta
    assert ds.columns == names
    assert len(ds) == len(records)
    assert ds.sample_ids == ids
    assert [s.sample_id for s in ds] == ids
    for i, (s, r) in enumerate(zip(ds, records)):
        assert s.index == i
        assert_sample(s, r)
    if records:
        assert_sample(ds[-1], records[-1])
        assert_sample(ds[-len(records)], records[0])
    with pytest.raises(IndexError):
        ds[len(records)]
    with pytest.raises(IndexError):
        ds[-len(records) - 1]

    picked = ids[::-2]
    view = ds.select(picked)
    assert len(view) == len(picked) and view.sample_ids == picked
    assert [s.sample_id for s in view] == picked
    by_id = {r.sample_id: r for r in records}
    for s in view:
        assert_sample(s, by_id[s.sample_id])
    assert view.table().column("sample_id").to_pylist() == picked

    for name in names:
        assert_tokens(ds.tokens(name), list(enumerate(records)), name, widths[name], dtype)
        start = 0
        for k, entry in enumerate(manifest.shards):
            items = list(enumerate(records))[start:start + entry.samples]
            assert [r.sample_id for _, r in items] == entry.sample_ids
            assert_tokens(ds.tokens(name, shard=k), items, name, widths[name], dtype)
            start += entry.samples
        # On a view, rows come in the view's order and point at its own indices.
        tm = view.tokens(name)
        assert tm.hidden.shape[0] == sum(by_id[i].num_rows for i in picked)
        for r in range(tm.hidden.shape[0]):
            s = view[int(tm.sample_index[r])]
            p = int(tm.position[r])
            assert torch.equal(bits(tm.hidden[r]), bits(s.hidden(name)[p]))
            assert int(tm.token_id[r]) == int(s.input_ids[p])

    t = ds.table()
    assert t.column_names == BASE_NAMES
    assert t.column("sample_id").to_pylist() == ids
    assert t.column("source_index").to_pylist() == [r.source_index for r in records]
    assert t.column("input_ids").to_pylist() == [r.input_ids.tolist() for r in records]
    assert t.column("accept_lens").to_pylist() == [None if r.accept_lens is None else r.accept_lens.tolist() for r in records]

    if manifest.shards:
        # One file opened on its own (through its directory's manifest, then copied out of it).
        entry = manifest.shards[-1]
        first = len(records) - entry.samples
        alone = Path(tempfile.mkdtemp(dir=d.parent)) / "alone.parquet"
        shutil.copy(d / entry.file, alone)
        for one in (hsx.open(d / entry.file), hsx.open(alone)):
            assert len(one) == entry.samples and one.metadata == meta
            for s, r in zip(one, records[first:]):
                assert_sample(s, r)
            for name in names:
                assert_tokens(one.tokens(name), [(i, r) for i, r in enumerate(records[first:])], name, widths[name], dtype)


# --------------------------------------------------------------------------- round-trips


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    widths=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    mode=st.sampled_from(["generate", "prefill"]),
    compression=st.sampled_from(["planes-zstd", "none", "zstd"]),
    tokens=st.lists(st.integers(0, 12), min_size=0, max_size=10),
    accept=st.sampled_from(["none", "all", "mixed"]),
    max_shard_samples=st.integers(1, 5),
    row_group_bytes=st.sampled_from([1, 600, 1 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_is_bit_exact(dtype, widths, mode, compression, tokens, accept, max_shard_samples, row_group_bytes, seed):
    meta = make_metadata(widths, dtype, mode, codec=compression)
    records = random_records(meta, tokens, accept, seed)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "out"
        write_sink(d, meta, records, max_shard_samples=max_shard_samples,
                   row_group_bytes=row_group_bytes)
        check_roundtrip(d, meta, records)


@pytest.mark.parametrize("compression", ["planes-zstd", "none", "zstd"])
@pytest.mark.parametrize("mode", ["generate", "prefill"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_roundtrip_over_several_shards_and_row_groups(tmp_path, dtype, mode, compression):
    meta = make_metadata([1, 257, 300], dtype, mode, codec=compression)
    tokens = [0, 1, 2, 7, 1, 12, 3, 0, 5, 9, 2]  # 0 and 1 rows in both modes
    records = random_records(meta, tokens, "mixed", seed=7)
    d = tmp_path / "out"
    m = write_sink(d, meta, records, max_shard_samples=4, row_group_bytes=2000)
    assert len(m.shards) == 3
    row_groups = [pq.ParquetFile(d / s.file).num_row_groups for s in m.shards]
    assert max(row_groups) >= 2, row_groups
    assert [s.samples for s in m.shards] == [4, 4, 3]
    assert sum(s.rows for s in m.shards) == sum(rows_for(n, mode) for n in tokens)
    assert sum(s.tokens for s in m.shards) == sum(tokens)
    check_roundtrip(d, meta, records)


@pytest.mark.parametrize("tokens", [[], [1], [2], [5]], ids=["0-samples", "1-sample-0-rows-gen", "1-sample-1-row-gen", "1-sample"])
def test_roundtrip_of_tiny_datasets(tmp_path, tokens):
    meta = make_metadata([3, 4], "bfloat16", "generate")
    records = random_records(meta, tokens, "all", seed=3)
    d = tmp_path / "out"
    write_sink(d, meta, records)
    check_roundtrip(d, meta, records)
    ds = hsx.open(d)
    assert ds.tokens("l1").hidden.shape == (sum(rows_for(n, "generate") for n in tokens), 4)
    assert ds.table().num_rows == len(tokens)


def test_empty_shard_file_reads_as_zero_samples(tmp_path):
    meta = make_metadata([6], "float16", "prefill")
    with ShardWriter(tmp_path / "empty.parquet", meta) as w:
        pass
    assert w.finalize().samples == 0
    ds = hsx.open(tmp_path / "empty.parquet")
    assert len(ds) == 0 and list(ds) == [] and ds.columns == ["l0"] and ds.metadata == meta
    assert ds.tokens("l0").hidden.shape == (0, 6)


def test_nan_and_inf_are_written_and_read_back_unchanged(tmp_path):
    meta = make_metadata([4], "bfloat16", "prefill")
    h = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    records = finite_records(meta, [2])
    records[0].hidden = {"l0": h}
    write_sink(tmp_path, meta, records)
    got = hsx.open(tmp_path)[0].hidden("l0")
    assert torch.equal(bits(got), bits(h))
    assert torch.isnan(got[0, 0]) and got[0, 1] == float("inf") and torch.signbit(got[0, 3])


# --------------------------------------------------------------------------- zero copy


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_hidden_states_are_views_of_arrow_buffers(tmp_path, dtype):
    meta = make_metadata([5, 8], dtype, "generate", codec="none")  # the rows layout: zero-copy
    records = finite_records(meta, [3, 4, 1, 6, 2, 5, 7], seed=1)
    m = write_sink(tmp_path, meta, records, max_shard_samples=3, row_group_bytes=1)
    assert len(m.shards) == 3  # the reader keeps up to 4 shards loaded: all stay in memory here
    ds = hsx.open(tmp_path)
    want = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    for name in ds.columns:
        samples = [ds[i] for i in range(len(ds))]
        chunks = ds.table([name]).column(name).chunks  # the loaded tables' own chunks
        spans = [(c.values.buffers()[-1].address, c.values.buffers()[-1].size) for c in chunks]  # the data buffer
        checked = 0
        for s in samples:
            h = s.hidden(name)
            assert h.dtype == want  # stored dtype, no conversion
            if h.numel() == 0:
                continue
            start, stop = h.data_ptr(), h.data_ptr() + h.numel() * h.element_size()
            assert any(a <= start and stop <= a + size for a, size in spans), (s.sample_id, name)
            checked += 1
        assert checked == sum(1 for r in records if r.num_rows)


def test_views_outlive_the_dataset(tmp_path):
    meta = make_metadata([16])
    records = finite_records(meta, [9, 4])
    write_sink(tmp_path, meta, records)
    h = hsx.open(tmp_path)[0].hidden("l0")
    gc.collect()
    torch.empty(1 << 20)  # reuse freed memory if the view did not keep the buffer alive
    assert torch.equal(bits(h), bits(records[0].hidden["l0"]))


# --------------------------------------------------------------------------- corruption


def contents(ds) -> list:
    """Every number a reader can get out of a dataset, as plain Python values."""
    out = []
    for s in ds:
        out.append((s.sample_id, s.source_index, s.input_ids.tolist(), s.prompt_len, s.loss_mask.tolist(),
                    s.finish_reason, s.verify_steps, None if s.accept_lens is None else s.accept_lens.tolist(),
                    [bits(s.hidden(n)).numpy().tobytes() for n in ds.columns]))
    for n in ds.columns:
        tm = ds.tokens(n)
        out.append((bits(tm.hidden).numpy().tobytes(), tm.sample_index.tolist(), tm.position.tolist(), tm.token_id.tolist()))
    out.append(ds.table().to_pylist())
    return out


def corrupt_dataset(d: Path, compression: str):
    meta = make_metadata([64, 32], "bfloat16", "generate")
    records = finite_records(meta, [9, 5, 12, 3, 8, 6], seed=11)
    write_sink(d, meta, records, compression=compression, max_shard_samples=3, row_group_bytes=1500)
    return meta, records


def chunk_span(path: Path, column: str, row_group: int = 0) -> tuple[int, int]:
    md = pq.ParquetFile(path).metadata
    names = [md.schema.column(j).path for j in range(md.num_columns)]
    cc = md.row_group(row_group).column(names.index(f"{column}.list.element" if column != "sample_id" else column))
    start = cc.dictionary_page_offset or cc.data_page_offset
    return start, start + cc.total_compressed_size


def footer_span(data: bytes) -> tuple[int, int]:
    n = int.from_bytes(data[-8:-4], "little")
    return len(data) - 8 - n, len(data) - 8


def corrupt(path: Path, where: str) -> None:
    data = bytearray(path.read_bytes())
    if where == "truncated-half":
        data = data[: len(data) // 2]
    elif where == "truncated-tail":
        data = data[:-1]
    elif where == "hidden-page-last-byte":
        data[chunk_span(path, "l0")[1] - 1] ^= 0x01
    elif where == "hidden-page-middle":
        a, b = chunk_span(path, "l1")
        data[(a + b) // 2 + 8] ^= 0x10
    elif where == "sample-id-page":
        data[chunk_span(path, "sample_id")[1] - 1] ^= 0x01
    elif where == "input-ids-page":
        data[chunk_span(path, "input_ids")[1] - 2] ^= 0x04
    elif where in ("footer-column-name-bit7", "footer-column-name-bit0"):
        a, b = footer_span(bytes(data))
        k = bytes(data).index(b"\x18\x02l1", a, b) + 2  # Thrift string header, then the name
        data[k] ^= 0x80 if where.endswith("bit7") else 0x01
    elif where == "footer-length":
        data[-8] ^= 0x01
    elif where == "footer-magic":
        data[-1] ^= 0x01
    else:
        raise AssertionError(where)
    path.write_bytes(bytes(data))


CORRUPTIONS = ["truncated-half", "truncated-tail", "hidden-page-last-byte", "hidden-page-middle", "sample-id-page",
               "input-ids-page", "footer-column-name-bit7", "footer-column-name-bit0", "footer-length", "footer-magic"]


@pytest.mark.parametrize("compression", ["planes-zstd", "none", "zstd"])
@pytest.mark.parametrize("where", CORRUPTIONS)
def test_corrupt_shard_in_a_directory_is_reported_and_never_read(tmp_path, compression, where):
    d = tmp_path / "out"
    _, records = corrupt_dataset(d, compression)
    corrupt(d / "shard-00001.parquet", where)

    result = CliRunner().invoke(app, ["verify", str(d)])
    assert result.exit_code == 1, result.output
    fault_lines = [ln for ln in result.output.splitlines() if "FAULT" in ln]
    assert any("shard-00001.parquet" in ln for ln in fault_lines), result.output
    assert not any("shard-00000.parquet" in ln for ln in fault_lines), result.output

    ds = hsx.open(d)
    with pytest.raises(ShardError, match="shard-00001.parquet"):
        contents(ds)
    with pytest.raises(ShardError, match="shard-00001.parquet"):
        ds[4].hidden("l0")
    # The intact shard still reads, bit-exact.
    for s, r in zip(ds.select([r.sample_id for r in records[:3]]), records[:3]):
        assert_sample(s, r)


def test_a_flip_no_parquet_check_sees_is_caught_by_the_manifest_checksum(tmp_path):
    """pyarrow reads the Arrow-schema copy of the metadata and ignores the plain key-value copy."""
    d = tmp_path / "out"
    corrupt_dataset(d, "none")
    f = d / "shard-00000.parquet"
    data = bytearray(f.read_bytes())
    a, b = footer_span(bytes(data))
    k = bytes(data).index(b'"layer_convention"', a, b) + 1
    data[k] ^= 0x01
    alone = tmp_path / "alone.parquet"
    alone.write_bytes(bytes(data))
    assert contents(hsx.open(alone)) == contents(hsx.open(f))  # invisible to the file's own checks
    f.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="shard-00000.parquet.*checksum"):
        contents(hsx.open(d))
    result = CliRunner().invoke(app, ["verify", str(d)])
    assert result.exit_code == 1 and "shard-00000.parquet" in result.output and "checksum" in result.output


@pytest.mark.parametrize("compression", ["planes-zstd", "none", "zstd"])
@pytest.mark.parametrize("where", CORRUPTIONS)
def test_corrupt_single_file_without_manifest_is_reported_and_never_read(tmp_path, compression, where):
    _, records = corrupt_dataset(tmp_path / "out", compression)
    f = tmp_path / "alone" / "part.parquet"
    f.parent.mkdir()
    shutil.copy(tmp_path / "out" / "shard-00001.parquet", f)
    corrupt(f, where)

    with pytest.raises(ShardError, match="part.parquet"):
        contents(hsx.open(f))
    result = CliRunner().invoke(app, ["verify", str(f)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and "part.parquet" in result.output and "FAULT" in result.output, result.output


@pytest.mark.parametrize("compression", ["planes-zstd", "none", "zstd"])
def test_any_flipped_byte_in_a_lone_shard_raises_or_changes_no_number(tmp_path, compression):
    """Sweep the whole file: page CRCs and schema checks must stop every change of a number."""
    meta = make_metadata([6, 3], "bfloat16", "generate")
    records = finite_records(meta, [4, 2, 6, 3], seed=5)
    write_sink(tmp_path / "out", meta, records, compression=compression, row_group_bytes=1)
    data = (tmp_path / "out" / "shard-00000.parquet").read_bytes()
    reference = contents(hsx.open(tmp_path / "out" / "shard-00000.parquet"))
    silent, raised, other = [], 0, []
    for pos in range(0, len(data), 5):
        b = bytearray(data)
        b[pos] ^= 0x80 if pos % 2 else 0x01
        f = tmp_path / f"flip-{pos}.parquet"  # a fresh file each time: never rewrite a mapped one
        f.write_bytes(bytes(b))
        try:
            got = contents(hsx.open(f))
        except ShardError as e:
            assert f.name in str(e)
            raised += 1
            continue
        except Exception as e:  # noqa: BLE001 - any other exception type is a failure to report
            other.append((pos, repr(e)[:120]))
            continue
        finally:
            f.unlink()
        if got != reference:
            silent.append(pos)
    assert not other, other
    assert not silent, f"flipped bytes at {silent} changed values without an error"
    assert raised > len(data) // 5 // 2  # most flips hit checked bytes


def test_flipped_bits_in_a_lone_shard_footer_schema_never_relabel_data(tmp_path):
    # Page CRCs do not cover the footer, and pyarrow takes the metadata from the footer's base64
    # Arrow-schema copy: without a manifest, only the metadata's own checksum guards it. Every
    # flip there must raise or leave the metadata exactly as written.
    meta = make_metadata([6, 3], "bfloat16", "generate")
    write_sink(tmp_path / "out", meta, finite_records(meta, [4, 2]))
    data = (tmp_path / "out" / "shard-00000.parquet").read_bytes()
    a, b = footer_span(data)
    md_value = pq.ParquetFile(pa.BufferReader(data)).metadata.metadata[b"ARROW:schema"]
    at = data.index(md_value, a, b)
    f = tmp_path / "lone.parquet"
    raised = changed = 0
    for pos in range(at, at + len(md_value), 3):
        for bit in (0, 1):
            out = bytearray(data)
            out[pos] ^= 1 << bit
            f.write_bytes(bytes(out))
            try:
                ds = hsx.open(f)
            except ShardError as e:
                assert f.name in str(e)
                raised += 1
                continue
            changed += ds.metadata != meta
    assert changed == 0
    assert raised > 0


def _rewrite_metadata(src: Path, dst: Path, meta_bytes: bytes | None) -> None:
    table = pq.read_table(src)
    table = table.replace_schema_metadata(
        None if meta_bytes is None else {METADATA_KEY: meta_bytes, METADATA_CHECKSUM_KEY: xxhash.xxh3_64_hexdigest(meta_bytes)}
    )
    pq.write_table(table, dst)


MALFORMED = {
    "no-hsx-key": lambda m: None,
    "not-json": lambda m: b"{not json",
    "future-version": lambda m: json.dumps({**m, "format_version": FORMAT_VERSION + 1}).encode(),
    "no-layers": lambda m: json.dumps({k: v for k, v in m.items() if k != "layers"}).encode(),
    "layers-not-a-list": lambda m: json.dumps({**m, "layers": 3}).encode(),
    "layer-without-width": lambda m: json.dumps({**m, "layers": [{"name": "l0"}]}).encode(),
    "layer-width-mismatch": lambda m: json.dumps({**m, "layers": [{**m["layers"][0], "width": 7}]}).encode(),
    "unknown-dtype": lambda m: json.dumps({**m, "dtype": "int4"}).encode(),
    "bfloat16-cells-labelled-int8": lambda m: json.dumps({**m, "dtype": "int8"}).encode(),
    "lossy-dtype-before-version-5": lambda m: json.dumps({**m, "dtype": "float8_e4m3", "format_version": 4}).encode(),
    "unknown-mode": lambda m: json.dumps({**m, "mode": "decode"}).encode(),
    "no-mode": lambda m: json.dumps({k: v for k, v in m.items() if k != "mode"}).encode(),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_shard_metadata_is_a_shard_error_naming_the_file(tmp_path, case):
    meta = make_metadata([5])
    write_sink(tmp_path / "out", meta, finite_records(meta, [3, 4]))
    f = tmp_path / "bad.parquet"
    _rewrite_metadata(tmp_path / "out" / "shard-00000.parquet", f, MALFORMED[case](meta))
    with pytest.raises(ShardError, match="bad.parquet"):
        contents(hsx.open(f))
    result = CliRunner().invoke(app, ["verify", str(f)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and "bad.parquet" in result.output, result.output


# --------------------------------------------------------------------------- leftovers of crashed writes


def test_stray_files_are_ignored_by_readers_and_listed_by_verify(tmp_path):
    d = tmp_path / "out"
    meta = make_metadata([8, 2], "float16")
    records = finite_records(meta, [4, 6, 3, 5, 2], seed=2)
    write_sink(d, meta, records, max_shard_samples=2)
    before = contents(hsx.open(d))
    # A half-written temp file of a crashed write, and a complete shard renamed just before the
    # crash that never reached the manifest.
    (d / ".shard-00005.parquet.tmp-123").write_bytes((d / "shard-00000.parquet").read_bytes()[:700])
    with ShardWriter(d / "shard-00009.parquet", meta) as w:
        w.write(finite_records(meta, [3, 3], seed=9))

    ds = hsx.open(d)
    assert len(ds) == len(records)
    assert contents(ds) == before
    with pytest.raises(ShardError, match="shard-00009.parquet"):
        hsx.open(d / "shard-00009.parquet")

    result = CliRunner().invoke(app, ["verify", str(d)])
    assert result.exit_code == 0, result.output
    ignored = [ln for ln in result.output.splitlines() if "ignored" in ln]
    assert any(".shard-00005.parquet.tmp-123" in ln for ln in ignored), result.output
    assert any("shard-00009.parquet" in ln for ln in ignored), result.output
    assert "verify: OK" in result.output
    as_json = json.loads(CliRunner().invoke(app, ["verify", str(d), "--json"]).output)
    assert as_json["ok"] and as_json["ignored"] == [".shard-00005.parquet.tmp-123", "shard-00009.parquet"]


def test_sink_shows_only_committed_records(tmp_path):
    meta = make_metadata([4])
    records = finite_records(meta, [3, 4, 5, 6, 7, 8], seed=4)
    sink = ShardSink(tmp_path, Manifest(meta), row_group_bytes=1)  # rows hit a temp file at once
    for r in records[:3]:
        sink.add(r)
    sink.add_error("bad-0", 77, "empty text")
    sink.commit()
    for r in records[3:5]:
        sink.add(r)
    sink.add_error("bad-1", 78, "too long")
    # Crash here: two records and one error added, not committed.
    assert (tmp_path / ".shard-00001.parquet.part").exists() and not (tmp_path / "shard-00001.parquet").exists()
    ds = hsx.open(tmp_path)
    assert ds.sample_ids == ["s000", "s001", "s002"]
    on_disk = load_manifest(tmp_path)
    assert on_disk.done_ids() == {"s000", "s001", "s002", "bad-0"}
    assert not on_disk.complete
    assert CliRunner().invoke(app, ["verify", str(tmp_path)]).exit_code == 0

    sink.commit()
    ds = hsx.open(tmp_path)
    assert ds.sample_ids == [r.sample_id for r in records[:5]]
    for s, r in zip(ds, records):
        assert_sample(s, r)
    assert load_manifest(tmp_path).done_ids() == {r.sample_id for r in records[:5]} | {"bad-0", "bad-1"}
    assert [e.reason for e in ds.errors] == ["empty text", "too long"]
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_a_resumed_sink_continues_numbering_after_the_last_shard(tmp_path):
    meta = make_metadata([4])
    records = finite_records(meta, [3, 4, 5, 6, 7], seed=6)
    write_sink(tmp_path, meta, records[:3], max_shard_samples=1)
    first = load_manifest(tmp_path)
    assert [s.file for s in first.shards] == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    old = {s.file: (tmp_path / s.file).read_bytes() for s in first.shards}

    sink = ShardSink(tmp_path, load_manifest(tmp_path), max_shard_samples=1)
    for r in records[3:]:
        sink.add(r)
    resumed = sink.close()
    assert [s.file for s in resumed.shards][3:] == ["shard-00003.parquet", "shard-00004.parquet"]
    assert all((tmp_path / f).read_bytes() == b for f, b in old.items())
    ds = hsx.open(tmp_path)
    assert ds.sample_ids == [r.sample_id for r in records]
    for s, r in zip(ds, records):
        assert_sample(s, r)


# --------------------------------------------------------------------------- no code execution


def test_reading_untrusted_shards_executes_no_deserialiser(tmp_path, monkeypatch):
    d = tmp_path / "out"
    meta = make_metadata([4, 4])
    records = finite_records(meta, [3, 5, 4], seed=8)
    write_sink(d, meta, records, max_shard_samples=2, errors=[("bad", 1, "empty")])

    calls = []

    def refuse(name):
        def f(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called while reading shards")
        return f

    import _pickle
    for mod in (pickle, _pickle):
        monkeypatch.setattr(mod, "loads", refuse("pickle.loads"))
        monkeypatch.setattr(mod, "load", refuse("pickle.load"))
        monkeypatch.setattr(mod, "Unpickler", refuse("pickle.Unpickler"))
    monkeypatch.setattr(torch, "load", refuse("torch.load"))

    ds = hsx.open(d)
    for s, r in zip(ds, records):
        assert_sample(s, r)
    ds.tokens("l0")
    ds.table()
    hsx.open(d / "shard-00000.parquet")[0].hidden("l1")
    from hsx.shards.verify import inspect, verify
    assert verify(d).ok
    assert inspect(d)["samples"] == 3
    assert CliRunner().invoke(app, ["verify", str(d)]).exit_code == 0
    assert CliRunner().invoke(app, ["inspect", str(d)]).exit_code == 0
    assert calls == []
    raw = (d / MANIFEST).read_text()
    assert json.loads(raw)["format"] == "hsx-manifest"


FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def unsafe_calls(source: str) -> list[str]:
    """Imports of deserialisers, eval/exec, and torch.load without weights_only=True in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("eval", "exec"):
                found.append(name)
            if name == "load" and isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "torch":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    found.append("torch.load")
    return found


def test_the_static_check_catches_unsafe_code():
    assert unsafe_calls("import pickle") == ["pickle"]
    assert unsafe_calls("from cloudpickle import loads") == ["cloudpickle"]
    assert unsafe_calls("import torch\ntorch.load(f)") == ["torch.load"]
    assert unsafe_calls("import torch\ntorch.load(f, weights_only=False)") == ["torch.load"]
    assert unsafe_calls("eval('1')") == ["eval"]
    assert unsafe_calls("import torch\ntorch.load(f, weights_only=True)") == []


def test_shard_modules_import_no_deserialiser():
    files = sorted((ROOT / "hsx" / "shards").glob("*.py")) + [ROOT / "hsx" / "__init__.py"]
    assert len(files) >= 6
    for f in files:
        assert unsafe_calls(f.read_text()) == [], f


# --------------------------------------------------------------------------- other readers


def test_metadata_columns_are_readable_by_other_tools(tmp_path, monkeypatch):
    d = tmp_path / "out"
    meta = make_metadata([6, 2], "bfloat16")
    records = finite_records(meta, [4, 6, 3, 5, 2], seed=12)
    m = write_sink(d, meta, records, max_shard_samples=2, compression="zstd")
    files = [str(d / s.file) for s in m.shards]
    ids = [r.sample_id for r in records]
    prompt = [r.prompt_len for r in records]

    t = pa.concat_tables([pq.read_table(f) for f in files])
    assert t.column("sample_id").to_pylist() == ids
    assert t.column("input_ids").to_pylist() == [r.input_ids.tolist() for r in records]
    assert t.column("l0").type == pa.list_(pa.large_binary())

    import pandas as pd
    # The whole shard, hidden columns included: one array of row bytes per sample.
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    assert list(df.columns) == BASE_NAMES + ["positions", "first_row", "l0", "l1"]
    assert df["sample_id"].tolist() == ids and df["prompt_len"].tolist() == prompt
    assert [list(x) for x in df["loss_mask"]] == [r.loss_mask.tolist() for r in records]
    for r, cell in zip(records, df["l0"]):
        assert len(cell) == r.num_rows and all(isinstance(x, bytes) and len(x) == 12 for x in cell)
        got = torch.frombuffer(bytearray(b"".join(cell)), dtype=torch.int16).view(-1, 6) if len(cell) else None
        assert got is None or torch.equal(got, bits(r.hidden["l0"]))

    import duckdb
    rows = duckdb.sql(f"select sample_id, prompt_len, len(l0), octet_length(l0[1]) from '{d}/*.parquet' "
                      "order by sample_id").fetchall()
    assert rows == sorted((i, p, r.num_rows, 12 if r.num_rows else None) for i, p, r in zip(ids, prompt, records))

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets
    hf = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert hf["sample_id"] == ids
    first = hf[0]["l0"]
    assert len(first) == records[0].num_rows and all(isinstance(x, bytes) and len(x) == 12 for x in first)
    assert torch.equal(torch.frombuffer(bytearray(b"".join(first)), dtype=torch.int16).view(-1, 6),
                       bits(records[0].hidden["l0"]))
