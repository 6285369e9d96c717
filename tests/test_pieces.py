"""Long samples in pieces (format 6): a small piece size forces the split, and every reader, loader,
export and recompute gives what the same records written whole give, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import hsx
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import ShardError
from hsx.export import export_saelens, export_speculators
from hsx.export.specforge import export_specforge
from hsx.run.pipeline import extract
from hsx.recompute import recompute
from hsx.shards import format as fmt
from hsx.shards.verify import inspect, verify
from shard_fixtures import bits, finite_records, make_metadata, random_records, rewrite, write_sink

LOSSLESS = ["bfloat16", "float16", "float32"]
CODECS = ["planes-zstd", "zstd", "none"]
# tokens per sample: a long one first and last, a no-row sample (1 token, generate mode), short ones between
TOKENS = [41, 3, 1, 26, 2, 17]
WIDTHS = [5, 12]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def piece_bytes(meta: dict, rows: int) -> int:
    """A piece size that holds ``rows`` rows of the widest column."""
    return rows * max(fmt.row_bytes(g["width"], meta["dtype"]) for g in meta["layers"])


def records_for(meta: dict, seed: int = 0):
    if meta["dtype"] in fmt.LOSSY:  # quantised from finite float rows
        return finite_records({**meta, "dtype": "float32"}, TOKENS, seed)
    return random_records(meta, TOKENS, "mixed", seed)


def pieces_of(path: Path) -> np.ndarray:
    return pa.concat_tables([pq.read_table(f, columns=["first_row"]) for f in sorted(path.glob("shard-*.parquet"))]) \
        .column("first_row").to_numpy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", LOSSLESS + list(fmt.LOSSY))
@pytest.mark.parametrize("mode", ["generate", "prefill"])
def test_pieces_read_back_as_the_whole_samples(tmp_path, codec, dtype, mode):
    meta = make_metadata(WIDTHS, dtype, mode, codec)
    records = records_for(meta)
    write_sink(tmp_path / "whole", meta, records)
    write_sink(tmp_path / "pieces", meta, records, piece_bytes=piece_bytes(meta, 4), max_shard_samples=4)
    first = pieces_of(tmp_path / "pieces")
    assert (first > 0).sum() >= 8 and not pieces_of(tmp_path / "whole").any()  # the long samples were cut
    whole, pieces = hsx.open(tmp_path / "whole"), hsx.open(tmp_path / "pieces")
    assert len(pieces) == len(records) and pieces.sample_ids == whole.sample_ids
    for r, a, b in zip(records, whole, pieces):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
        assert b.num_rows == r.num_rows and b.prompt_len == r.prompt_len
        for name in pieces.columns:
            assert same_bits(b.hidden(name), a.hidden(name)), (r.sample_id, name)
            if dtype in LOSSLESS:
                assert same_bits(b.hidden(name), r.hidden[name]), (r.sample_id, name)
    for name in pieces.columns:
        ta, tb = whole.tokens(name), pieces.tokens(name)
        assert same_bits(tb.hidden, ta.hidden)
        assert torch.equal(tb.sample_index, ta.sample_index) and torch.equal(tb.position, ta.position)
        assert torch.equal(tb.token_id, ta.token_id)
    # the random records hold NaNs and accept lengths that do not add up, on purpose: verify says the same of both
    reports = {name: verify(tmp_path / name) for name in ("whole", "pieces")}
    said = {name: sorted(f for s in r.shards for f in s.faults if "NaN/Inf" not in f) for name, r in reports.items()}
    assert said["pieces"] == said["whole"] and not reports["pieces"].faults
    assert reports["pieces"].samples == len(records)
    assert sum(s.rows for s in reports["pieces"].shards) == sum(r.num_rows for r in records)
    ia, ib = inspect(tmp_path / "whole"), inspect(tmp_path / "pieces")
    for key in ("samples", "tokens", "rows_per_column", "finish_reasons"):
        assert ia[key] == ib[key], key


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", LOSSLESS + list(fmt.LOSSY))
def test_part_of_a_sample_is_read_without_decoding_the_rest(tmp_path, codec, dtype):
    meta = make_metadata(WIDTHS, dtype, "prefill", codec)
    records = records_for(meta, seed=5)
    write_sink(tmp_path / "out", meta, records, piece_bytes=piece_bytes(meta, 4))
    whole = [{c: s.hidden(c).clone() for c in s.hidden} for s in hsx.open(tmp_path / "out")]
    ds = hsx.open(tmp_path / "out")  # fresh: nothing decoded yet
    for j, s in enumerate(ds):
        n = s.num_rows
        for a, b in [(0, n), (1, n - 1), (3, 9), (4, 8), (n - 1, n), (5, 5), (-3, None), (7, 100)]:
            for c in ds.columns:
                got = s.hidden(c, rows=slice(a, b))
                assert same_bits(got, whole[j][c][a:b]), (s.sample_id, c, a, b)
                assert got.shape[1] == whole[j][c].shape[1]
    assert not any(shard._blocks for shard in ds._cache.values())  # no chunk was decoded whole
    with pytest.raises(TypeError, match="slice of consecutive rows"):
        ds[0].hidden("l0", rows=slice(0, 4, 2))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("where", ["all", "loss"])
def test_the_loader_streams_pieces_as_the_whole_samples(tmp_path, codec, dtype, where):
    meta = make_metadata(WIDTHS, dtype, "generate", codec)
    records = records_for(meta, seed=2)
    write_sink(tmp_path / "whole", meta, records)
    write_sink(tmp_path / "pieces", meta, records, piece_bytes=piece_bytes(meta, 3), max_shard_samples=3)
    batches = {}
    for name in ("whole", "pieces"):
        loader = hsx.tokens_loader(tmp_path / name, where=where, batch_size=7, shuffle_buffer=0)
        got = list(loader)
        batches[name] = {k: torch.cat([b[k] for b in got]) for k in got[0]}
    a, b = batches["whole"], batches["pieces"]
    assert set(a) == set(b) and len(a["position"]) > 40
    for k in a:
        assert same_bits(b[k], a[k]) if b[k].is_floating_point() else torch.equal(b[k], a[k]), k
    # several consumers share the samples, each row once
    parts = [list(hsx.tokens_loader(tmp_path / "pieces", where=where, batch_size=5, shuffle_buffer=16, rank=r,
                                    world_size=2)) for r in range(2)]
    seen = sorted(zip(torch.cat([x["sample_index"] for p in parts for x in p]).tolist(),
                      torch.cat([x["position"] for p in parts for x in p]).tolist()))
    assert seen == sorted(zip(a["sample_index"].tolist(), a["position"].tolist()))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3"])
def test_pandas_pyarrow_and_datasets_see_pieces_that_decode_to_the_sample(tmp_path, codec, dtype):
    import datasets
    import pandas as pd

    meta = make_metadata(WIDTHS, dtype, "prefill", codec)
    write_sink(tmp_path / "out", meta, records_for(meta, seed=3), piece_bytes=piece_bytes(meta, 5))
    ds = hsx.open(tmp_path / "out")
    files = sorted((tmp_path / "out").glob("shard-*.parquet"))
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    assert len(df) > len(ds) and (df["first_row"] == 0).sum() == len(ds)
    assert df[df["first_row"] == 0]["sample_id"].tolist() == ds.sample_ids
    for s in ds:
        rows = df[df["sample_id"] == s.sample_id].sort_values("first_row")
        for name in ds.columns:
            cells = list(rows[name])
            one = hsx.decode([v for c in cells for v in c], s.hidden(name).shape[1], dtype, codec)
            by_piece = np.concatenate([hsx.decode(c, s.hidden(name).shape[1], dtype, codec) for c in cells])
            want = s.hidden(name).float().numpy() if dtype in fmt.LOSSY else \
                s.hidden(name).contiguous().view(bits(s.hidden(name)).dtype).numpy().view(one.dtype)
            assert np.array_equal(one.view(np.uint8), want.view(np.uint8)), (s.sample_id, name)
            assert np.array_equal(by_piece.view(np.uint8), one.view(np.uint8))
        assert np.concatenate(list(rows["positions"])).tolist() == s.positions.tolist()
    hf = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    assert hf.num_rows == len(df) and hf.column_names == list(df.columns)


def test_a_piece_out_of_place_is_refused(tmp_path):
    meta = make_metadata(WIDTHS, "bfloat16", "generate", "none")
    write_sink(tmp_path / "out", meta, records_for(meta), piece_bytes=piece_bytes(meta, 4))
    (shard,) = sorted((tmp_path / "out").glob("shard-*.parquet"))
    table = pq.read_table(shard)
    first = table.column("first_row").to_numpy().copy()
    k = int(np.flatnonzero(first > 0)[1])
    first[k] += 1  # a piece that claims to start a row later than its earlier pieces end
    shifted = table.set_column(table.column_names.index("first_row"), "first_row", pa.array(first))
    with pytest.raises(ShardError, match=r"starts at row \d+; its earlier pieces hold \d+ rows"):
        fmt.join_pieces(shifted, meta, "edited")
    ids = table.column("sample_id").to_pylist()
    ids[k] = "someone-else"
    renamed = table.set_column(0, "sample_id", pa.array(ids))
    with pytest.raises(ShardError, match="is a piece of 'someone-else' inside sample"):
        fmt.join_pieces(renamed, meta, "edited")


# ---- through a run: the exports and recompute -----------------------------------------------------

ROWS = [
    {"id": "a", "text": "The quick brown fox jumps over the lazy dog, and then it runs back over the hill again."},
    {"id": "b", "text": "Hi"},
    {"id": "c", "messages": [{"role": "user", "content": "Why is the sky blue in the day and dark at night?"},
                             {"role": "assistant", "content": "Light scatters off the air; at night the sun is away."}]},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pieces-run")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=8, hidden_size=32, vocab_size=len(tok), seed=4,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = {"root": root}
    for mode in ("prefill", "generate"):
        extract(ExtractConfig(model=str(root / "target"), dataset=str(data), output=str(root / mode), id_field="id",
                              mode=mode, max_new_tokens=8, layers="final,eagle3,8,3", batch_size=2), progress=False)
        meta = hsx.open(root / mode).metadata
        out[mode] = root / mode
        out[f"{mode}-pieces"] = rewrite(root / mode, root / f"{mode}-pieces", lambda k, s, h: None,
                                        piece_bytes=piece_bytes(meta, 3))
    return out


def tensors_in(path: Path) -> dict[str, object]:
    """Every tensor (and plain value) of an export's safetensors and .ckpt files, by file and key."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.suffix == ".safetensors":
            out.update({f"{p.relative_to(path)}:{k}": v for k, v in load_file(p).items()})
        elif p.suffix in (".ckpt", ".pt"):
            got = torch.load(p, weights_only=True)
            out.update({f"{p.relative_to(path)}:{k}": v for k, v in (got.items() if isinstance(got, dict) else [("", got)])})
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return a == b


@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_exports_of_pieces_equal_the_exports_of_whole_samples(run, tmp_path, mode):
    import datasets

    assert (pieces_of(run[f"{mode}-pieces"]) > 0).sum() >= 4 and verify(run[f"{mode}-pieces"]).ok
    for name in (mode, f"{mode}-pieces"):
        export_specforge(run[name], tmp_path / name / "specforge", progress=False, draft_vocab_size=64)
        export_speculators(run[name], tmp_path / name / "speculators", progress=False)
        export_saelens(run[name], tmp_path / name / "saelens", column="b3", context_size=8, progress=False)
    for kind in ("specforge", "speculators"):
        a, b = tensors_in(tmp_path / mode / kind), tensors_in(tmp_path / f"{mode}-pieces" / kind)
        assert a.keys() == b.keys() and a
        for key in a:
            assert same(a[key], b[key]), key
    a = datasets.load_from_disk(str(tmp_path / mode / "saelens")).with_format("numpy")
    b = datasets.load_from_disk(str(tmp_path / f"{mode}-pieces" / "saelens")).with_format("numpy")
    assert a.num_rows == b.num_rows > 0
    for column in a.column_names:
        assert np.array_equal(a[column], b[column]), column


def test_recompute_passes_on_pieces_and_catches_a_shift_inside_one(run, tmp_path):
    report = recompute(run["generate-pieces"], progress=False)
    assert report.ok and len(report.samples) == len(ROWS) and report.rows > 0, report
    meta = hsx.open(run["generate"]).metadata

    def shift(k, s, hidden):
        if s.sample_id == "a":  # rows 4.. hold the state of the position after theirs
            for name in hidden:
                hidden[name] = torch.cat([hidden[name][:4], hidden[name][5:], hidden[name][-1:]])

    bad = rewrite(run["generate"], tmp_path / "shifted", shift, piece_bytes=piece_bytes(meta, 3))
    report = recompute(bad, progress=False)
    assert not report.ok
    assert {s.sample_id for s in report.samples if s.findings} == {"a"}
