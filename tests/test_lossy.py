"""Lossy hidden-state dtypes (int8, float8_e4m3 with per-group scales): error bounds, round trips, refusals."""

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
from hsx.shards import Manifest, ShardSink, quant
from hsx.shards import format as fmt
from hsx.shards.loader import tokens_loader
from hsx.shards.verify import verify
from shard_fixtures import finite_records, make_metadata, write_sink

KINDS = ["int8", "float8_e4m3"]
INPUTS = [torch.bfloat16, torch.float16, torch.float32]
WIDTHS = [1, 63, 64, 65, 200]


def rows_of(width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows over six decades of scale, one with an outlier per group, one of zeros, one of a single value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, width, generator=gen) * torch.logspace(-3, 3, 40)[:, None]
    x[5, ::64] *= 300.0
    x[7] = 0.0
    x[9] = 0.0
    x[9, width // 2] = -3.5
    return x.clamp(-6e4, 6e4).to(dtype)


def per_value_scale(scale: torch.Tensor, width: int) -> torch.Tensor:
    return scale.float().repeat_interleave(quant.GROUP, dim=1)[:, :width]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", INPUTS)
def test_int8_moves_each_value_by_at_most_half_its_scale(dtype, width):
    x = rows_of(width, dtype)
    codes, scale = quant.quantize(x, "int8")
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scale.shape == (40, quant.groups(width))
    s = per_value_scale(scale, width)
    err = (quant.dequantize(codes, scale, torch.float32) - x.float()).abs()
    # half a scale, plus float32 rounding of the division and the product
    assert (err <= s / 2 * (1 + 1e-6) + x.float().abs() * 2.0**-22).all()
    # a scale is its group's absmax / 127, rounded up to bfloat16
    groups = torch.nn.functional.pad(x.float().abs(), (0, scale.shape[1] * 64 - width)).view(40, -1, 64).amax(-1)
    assert (scale.float() >= groups / 127).all() and (scale.float() <= groups / 127 * (1 + 2.0**-6)).all()
    assert torch.equal(codes[7], torch.zeros_like(codes[7])) and (scale[7] == 0).all()
    assert (err.amax(dim=1) > 0).any()  # the codec is lossy: a bound that could not fail would hide nothing


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", INPUTS)
def test_float8_keeps_each_value_within_its_relative_bound(dtype, width):
    x = rows_of(width, dtype)
    codes, scale = quant.quantize(x, "float8_e4m3")
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16
    s = per_value_scale(scale, width)
    err = (quant.dequantize(codes, scale, torch.float32) - x.float()).abs()
    # 3 mantissa bits: 2^-4 relative; below e4m3's smallest normal (2^-6) its spacing 2^-9, half of it absolute
    assert (err <= x.float().abs() * 2.0**-4 * (1 + 1e-6) + s * 2.0**-10).all()
    if width > 1:  # a group of one value is its own scale
        assert (err > x.float().abs() * 2.0**-6).any()


@pytest.mark.parametrize("kind", KINDS)
def test_read_back_as_bfloat16_adds_only_its_rounding(kind):
    x = rows_of(130, torch.float32)
    codes, scale = quant.quantize(x, kind)
    exact = quant.dequantize(codes, scale, torch.float32)
    assert torch.equal(quant.dequantize(codes, scale), exact.to(torch.bfloat16))


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_values_are_refused_when_written(tmp_path, kind):
    meta = make_metadata([70], "float32", "prefill")
    records = finite_records(meta, [3, 4])
    records[1].hidden["l0"][2, 66] = float("nan")
    with pytest.raises(ShardError, match="inf or NaN"):
        write_sink(tmp_path / "out", {**meta, **make_metadata([70], kind, "prefill")}, records)


@pytest.mark.parametrize("codec", ["planes-zstd", "zstd", "none"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_reader_gives_the_dequantised_rows(tmp_path, kind, codec):
    source = make_metadata([100, 64, 1], "float32", "prefill")
    records = finite_records(source, [3, 0, 5, 7, 2], seed=4)
    meta = make_metadata([100, 64, 1], kind, "prefill", codec=codec)
    assert meta["format_version"] == fmt.FORMAT_VERSION >= 5 and meta["layers"][0]["row_bytes"] == 100 + 2 * 2
    write_sink(tmp_path, meta, records, row_group_bytes=900)  # several row groups
    ds = hsx.open(tmp_path)
    want = {g["name"]: [quant.dequantize(*quant.quantize(r.hidden[g["name"]], kind)) for r in records] for g in meta["layers"]}
    for k, s in enumerate(ds):
        for name in ds.columns:
            got = s.hidden(name)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want[name][k])
        if s.num_rows:
            with pytest.raises(ValueError, match="read-only"):
                s.hidden("l0").add_(1)  # read-only, as lossless blocks are
    for name in ds.columns:
        assert torch.equal(ds.tokens(name).hidden, torch.cat(want[name]))
    loaded = list(tokens_loader(tmp_path, shuffle_buffer=0, batch_size=1000))
    assert len(loaded) == 1 and torch.equal(loaded[0]["l0"], torch.cat(want["l0"]))
    table = pq.read_table(sorted(tmp_path.glob("shard-*.parquet"))[0])
    for k in range(table.num_rows):
        got = hsx.decode(table.column("l0")[k].as_py(), 100, kind, codec)
        assert got.dtype == np.float32 and np.array_equal(got, want["l0"][k].float().numpy())
    assert not verify(tmp_path).faults


@pytest.mark.parametrize("kind", KINDS)
def test_lossy_shards_are_smaller_than_bfloat16(tmp_path, kind):
    source = make_metadata([256], "bfloat16", "prefill")
    records = finite_records(source, [64] * 8)
    sizes = {}
    for dtype in ("bfloat16", kind):
        m = write_sink(tmp_path / dtype, make_metadata([256], dtype, "prefill"), records)
        sizes[dtype] = sum(e.bytes for e in m.shards)
    assert sizes[kind] < 0.75 * sizes["bfloat16"], sizes


def _relabel(src: Path, dst: Path, edit) -> None:
    table = pq.read_table(src)
    meta = edit(json.loads(table.schema.metadata[fmt.METADATA_KEY]))
    blob = json.dumps(meta).encode()
    pq.write_table(table.replace_schema_metadata({fmt.METADATA_KEY: blob, fmt.METADATA_CHECKSUM_KEY: xxhash.xxh3_64_hexdigest(blob)}), dst)


def test_an_older_reader_refuses_a_newer_shard(tmp_path, monkeypatch):
    meta = make_metadata([70], "int8", "prefill")
    write_sink(tmp_path / "out", meta, finite_records(make_metadata([70], "float32", "prefill"), [3]))
    monkeypatch.setattr(fmt, "READABLE_VERSIONS", (1, 2, 3, 4))
    with pytest.raises(ShardError, match=f"version {fmt.FORMAT_VERSION}; this hsx reads versions 1, 2, 3, 4"):
        hsx.open(tmp_path / "out" / "shard-00000.parquet")


@pytest.mark.parametrize("codec", ["planes-zstd", "none"])
def test_lossy_cells_of_the_wrong_width_are_refused(tmp_path, codec):
    # int8 cells relabelled as a column of another width: the codes and scales no longer fit
    meta = make_metadata([70], "int8", "prefill", codec=codec)
    write_sink(tmp_path / "out", meta, finite_records(make_metadata([70], "float32", "prefill"), [3, 2]))
    bad = tmp_path / "bad.parquet"
    _relabel(tmp_path / "out" / "shard-00000.parquet", bad,
             lambda m: {**m, "layers": [{**m["layers"][0], "width": 50}]})
    with pytest.raises(ShardError, match="bad.parquet"):
        [s.hidden("l0") for s in hsx.open(bad)]


def test_a_decoded_cell_of_the_wrong_shape_is_refused():
    with pytest.raises(ShardError, match="3"):
        hsx.decode([b"\x01\x02", b"\x00"], 2, "int8", "planes-zstd")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer

    root = tmp_path_factory.mktemp("lossy")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=6, hidden_size=96, vocab_size=len(tok), seed=3,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rows = [{"id": f"t{i}", "text": "the quick brown fox jumps over the lazy dog " * (1 + i)} for i in range(5)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "target": str(root / "target"), "data": str(root / "data.jsonl")}


def cli_extract(tiny: dict, dtype: str, mode: str) -> Path:
    from typer.testing import CliRunner

    from hsx.cli import app

    out = tiny["root"] / f"{mode}-{dtype}"
    if not out.exists():
        result = CliRunner().invoke(app, ["extract", "--model", tiny["target"], "--dataset", tiny["data"], "--id-field", "id",
                                          "--mode", mode, "--max-new-tokens", "6", "--layers", "final,eagle3,2",
                                          "--dtype", dtype, "--output", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("mode", ["prefill", "generate"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_extract_with_a_lossy_dtype_reads_back_within_its_bound(tiny, kind, mode):
    from hsx.eagle3 import Eagle3Dataset
    from hsx.compare.tolerance import UNIT_ROUNDOFF

    ref, lossy = hsx.open(cli_extract(tiny, "float32", mode)), hsx.open(cli_extract(tiny, kind, mode))
    assert lossy.metadata["dtype"] == kind and lossy.metadata["format_version"] == fmt.FORMAT_VERSION >= 5
    assert lossy.sample_ids == ref.sample_ids and len(lossy) == 5
    for name in ref.columns:
        want, got = ref.tokens(name).hidden.double(), lossy.tokens(name).hidden
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        rel = (got.double() - want).norm(dim=1) / want.norm(dim=1)
        assert 0 < rel.max() <= UNIT_ROUNDOFF[kind], (name, rel.max())
    for a, b in zip(Eagle3Dataset(ref), Eagle3Dataset(lossy)):
        assert torch.equal(a["input_ids"], b["input_ids"]) and b["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.allclose(a["aux_hidden_state"].float(), b["aux_hidden_state"].float(), rtol=0.1, atol=0.1)
    assert not verify(cli_extract(tiny, kind, mode)).faults
