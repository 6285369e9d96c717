"""`hsx export speculators` and `hsx export saelens`: layouts, values against the shards (and the
last state against an independent forward), packing, refusals, resume, the CLI. The consumers' own
readers run in scripts/consumers_check.sh."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError
from hsx.export import export_saelens, export_speculators, hook_name_for
from hsx.export.hfdisk import DiskDatasetWriter
from hsx.run.pipeline import extract
from oracle import oracle_sources

NUM_LAYERS, HIDDEN = 8, 64
AUX = [2, 4, 5]  # the eagle3 default for L = 8

ROWS = [
    {"id": "chat-a", "messages": [{"role": "user", "content": "How do tides work?"},
                                  {"role": "assistant", "content": "The Moon pulls on the oceans."}]},
    {"id": "text-b", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "chat-c", "messages": [{"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": "Blue, like the sky on a clear day in June."}]},
    {"id": "one", "text": "A"},
    {"id": "text-d", "text": "Bread is made of flour, water, salt and yeast, and it rises."},
]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("consumers")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=HIDDEN, vocab_size=len(tok), seed=5,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = {"root": root, "model": target}
    runs = {"prefill": dict(mode="prefill", layers="final,eagle3,8,3"),
            "generate": dict(mode="generate", max_new_tokens=9, layers="final,eagle3,8,3"),
            "final_only": dict(mode="prefill", layers="final,eagle3"),
            "completion": dict(mode="generate", max_new_tokens=6, layers="eagle3,8,3", keep="completion")}
    for name, kw in runs.items():
        extract(ExtractConfig(model=str(root / "target"), dataset=str(data), output=str(root / name), id_field="id",
                              batch_size=2, max_shard_samples=2, **kw), progress=False)
        out[name] = root / name
    return out


def rows_of(s, boundary: int) -> torch.Tensor:
    """Boundary ``boundary`` of a sample, read from whichever column holds it, by hand."""
    if boundary in AUX:
        k = AUX.index(boundary)
        return s.hidden("eagle3")[:, k * HIDDEN:(k + 1) * HIDDEN]
    return s.hidden(f"b{boundary}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


# ---------------------------------------------------------------- speculators

@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_speculators_files_hold_the_shards(env, tmp_path, mode):
    s = export_speculators(env[mode], tmp_path / "out", progress=False)
    shards = hsx.open(env[mode])
    index = [json.loads(x) for x in (tmp_path / "out" / "hsx_index.jsonl").read_text().splitlines()]
    table = datasets.load_from_disk(str(tmp_path / "out"))
    assert table.format["type"] == "torch" and table.column_names == ["input_ids", "loss_mask", "seq_len"]
    short = [i for i in range(len(shards)) if len(shards[i].input_ids) - (mode == "generate") < 2]
    assert s.samples == len(index) == len(table) == len(shards) - len(short) and s.skipped_short == len(short)
    assert s.target_layer_ids == AUX and s.num_layers == NUM_LAYERS
    by_id = {shards[i].sample_id: shards[i] for i in range(len(shards))}
    freq = Counter()
    for e in index:
        sample = by_id[e["sample_id"]]
        n = len(sample.input_ids)
        t = n - 1 if mode == "generate" else n
        f = load_file(tmp_path / "out" / "hidden_states" / f"hs_{e['index']}.safetensors")
        assert set(f) == {"token_ids", "hidden_states"}
        assert f["token_ids"].dtype == torch.int64 and torch.equal(f["token_ids"], sample.input_ids[:t].long())
        assert f["hidden_states"].shape == (t, len(AUX) + 1, HIDDEN) and f["hidden_states"].dtype == torch.bfloat16
        for k, b in enumerate([*AUX, NUM_LAYERS]):
            assert torch.equal(bits(f["hidden_states"][:, k]), bits(rows_of(sample, b)[:t]))
        row = table[e["index"]]
        assert torch.equal(row["input_ids"], f["token_ids"]) and int(row["seq_len"]) == t
        assert torch.equal(row["loss_mask"], sample.loss_mask[:t].long())
        freq.update(sample.input_ids[:t][sample.loss_mask[:t].bool()].tolist())
    assert torch.load(tmp_path / "out" / "token_freq.pt", weights_only=True) == dict(freq)
    info = json.loads((tmp_path / "out" / "hsx_export.json").read_text())
    assert info["complete"] and info["target_layer_ids"] == AUX and info["verifier_boundary"] == NUM_LAYERS


def test_speculators_last_layer_is_the_last_block_output_not_the_final_norm(env, tmp_path):
    """hidden_states[:, -1] is boundary L of an independent forward; speculators applies the norm itself."""
    export_speculators(env["prefill"], tmp_path / "out", progress=False)
    shards = hsx.open(env["prefill"])
    for i in range(len(shards)):
        f = load_file(tmp_path / "out" / "hidden_states" / f"hs_{i}.safetensors")
        ref = oracle_sources(env["model"], shards[i].input_ids)
        torch.testing.assert_close(f["hidden_states"][:, -1].float(), ref[NUM_LAYERS], rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(f["hidden_states"][:, 0].float(), ref[AUX[0]], rtol=1e-2, atol=1e-3)
        assert (f["hidden_states"][:, -1].float() - ref["final"]).abs().max() > 0.05


def test_speculators_layer_ids_given_are_sorted_and_read_from_any_column(env, tmp_path):
    s = export_speculators(env["prefill"], tmp_path / "out", target_layer_ids=[5, 3], progress=False)
    assert s.target_layer_ids == [3, 5]
    shard = hsx.open(env["prefill"])[0]
    f = load_file(tmp_path / "out" / "hidden_states" / "hs_0.safetensors")
    assert torch.equal(bits(f["hidden_states"][:, 0]), bits(shard.hidden("b3")))
    assert torch.equal(bits(f["hidden_states"][:, 1]), bits(shard.hidden("eagle3")[:, 2 * HIDDEN:]))


@pytest.mark.parametrize("run, ids, message", [
    ("final_only", None, r"no column holds boundary 8.*--layers \.\.\.,8"),
    ("completion", None, r"keep only 'completion' positions"),
    ("prefill", [2, 8], r"\[8\] outside 0\.\.7.*always added as the last layer"),
    ("prefill", [2, 2], r"distinct"),
    ("prefill", [6], r"no column holds boundary 6"),
])
def test_speculators_refuses_what_it_cannot_express(env, tmp_path, run, ids, message):
    with pytest.raises(HsxError, match=message):
        export_speculators(env[run], tmp_path / "out", target_layer_ids=ids, progress=False)


def test_speculators_needs_layer_ids_without_an_eagle3_column(env, tmp_path):
    src = tmp_path / "b_only"
    extract(ExtractConfig(model=str(env["root"] / "target"), dataset=str(env["root"] / "data.jsonl"), output=str(src),
                          id_field="id", mode="prefill", layers="3,8", limit=2), progress=False)
    with pytest.raises(HsxError, match=r"no --target-layer-ids given and no 'eagle3' column"):
        export_speculators(src, tmp_path / "out", progress=False)
    assert export_speculators(src, tmp_path / "out", target_layer_ids=[3], progress=False).samples == 2


def test_speculators_resume_keeps_whole_files_and_rewrites_broken_ones(env, tmp_path):
    dst = tmp_path / "out"
    first = export_speculators(env["generate"], dst, progress=False)
    assert first.written == first.samples and first.kept == 0
    victim = dst / "hidden_states" / "hs_1.safetensors"
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 2])
    (dst / "hidden_states" / ".hs_2.safetensors.tmp-999").write_bytes(b"junk")
    again = export_speculators(env["generate"], dst, progress=False)
    assert (again.written, again.kept) == (1, first.samples - 1) and victim.read_bytes() == good
    assert not list((dst / "hidden_states").glob(".*tmp-*"))
    with pytest.raises(HsxError, match="holds another export"):
        export_speculators(env["prefill"], dst, progress=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(HsxError, match="not an hsx export"):
        export_speculators(env["prefill"], foreign, progress=False)


# ---------------------------------------------------------------- SAELens

def stream(shards, boundary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every stored row of a boundary in dataset order, with its input token."""
    rows, toks = [], []
    for i in range(len(shards)):
        s = shards[i]
        rows.append(rows_of(s, boundary).float())
        toks.append(s.input_ids.long()[s.positions])
    return torch.cat(rows), torch.cat(toks)


@pytest.mark.parametrize("mode, boundary, context_size", [("prefill", 3, 8), ("generate", 4, 5), ("prefill", 8, 16),
                                                          ("generate", 3, 1)])
def test_saelens_contexts_are_the_rows_back_to_back(env, tmp_path, mode, boundary, context_size):
    s = export_saelens(env[mode], tmp_path / "out", column=f"b{boundary}", context_size=context_size, progress=False)
    hook = f"blocks.{boundary}.hook_resid_pre" if boundary < NUM_LAYERS else f"blocks.{NUM_LAYERS - 1}.hook_resid_post"
    assert s.hook_name == hook and s.d_in == HIDDEN
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert ds.features[hook].shape == (context_size, HIDDEN) and ds.features[hook].dtype == "float32"
    assert ds.features["token_ids"].length == context_size and ds.features["token_ids"].feature.dtype == "int32"
    rows, toks = stream(hsx.open(env[mode]), boundary)
    k = len(rows) // context_size
    assert s.contexts == len(ds) == k and s.dropped_tokens == len(rows) - k * context_size < context_size
    got = ds.with_format("torch")[:]
    assert torch.equal(got[hook].reshape(-1, HIDDEN), rows[: k * context_size])
    assert torch.equal(got["token_ids"].reshape(-1), toks[: k * context_size])


def test_saelens_one_context_per_sample(env, tmp_path):
    c = 10
    s = export_saelens(env["prefill"], tmp_path / "out", column="3", context_size=c, concat=False, progress=False)
    shards = hsx.open(env["prefill"])
    long_enough = [shards[i] for i in range(len(shards)) if shards[i].num_rows >= c]
    ds = datasets.load_from_disk(str(tmp_path / "out")).with_format("torch")
    assert 0 < len(long_enough) < len(shards) and s.contexts == len(ds) == len(long_enough)
    assert s.dropped_tokens == sum(shards[i].num_rows for i in range(len(shards))) - c * len(long_enough)
    for j, sample in enumerate(long_enough):
        assert torch.equal(ds[j]["blocks.3.hook_resid_pre"], sample.hidden("b3")[:c].float())
        assert torch.equal(ds[j]["token_ids"], sample.input_ids[:c].long())


def test_saelens_kept_positions_carry_their_tokens(env, tmp_path):
    s = export_saelens(env["completion"], tmp_path / "out", column="b8", context_size=3, progress=False)
    rows, toks = stream(hsx.open(env["completion"]), NUM_LAYERS)
    ds = datasets.load_from_disk(str(tmp_path / "out")).with_format("torch")[:]
    n = s.contexts * 3
    assert torch.equal(ds["blocks.7.hook_resid_post"].reshape(-1, HIDDEN), rows[:n])
    assert torch.equal(ds["token_ids"].reshape(-1), toks[:n])


def test_saelens_final_float16_and_a_given_hook_name(env, tmp_path):
    s = export_saelens(env["prefill"], tmp_path / "out", column="final", context_size=4, dtype="float16",
                       hook_name="model.norm", progress=False)
    ds = datasets.load_from_disk(str(tmp_path / "out")).with_format("numpy")
    assert s.hook_name == "model.norm" and ds.features["model.norm"].dtype == "float16"
    first = hsx.open(env["prefill"])[0].hidden("final")[:4]
    assert np.array_equal(ds[0]["model.norm"], first.to(torch.float16).numpy())
    assert hook_name_for("final", NUM_LAYERS) == "ln_final.hook_normalized"
    assert hook_name_for(0, NUM_LAYERS) == "blocks.0.hook_resid_pre"


def test_saelens_rerun_leaves_a_finished_export_and_redoes_an_unfinished_one(env, tmp_path):
    dst = tmp_path / "out"
    first = export_saelens(env["prefill"], dst, column="b3", context_size=4, progress=False)
    assert not first.skipped and first.bytes_written > 0
    again = export_saelens(env["prefill"], dst, column="b3", context_size=4, progress=False)
    assert again.skipped and again.contexts == first.contexts
    (dst / "state.json").unlink()  # as if the export had stopped before its last step
    redone = export_saelens(env["prefill"], dst, column="b3", context_size=4, progress=False)
    assert not redone.skipped and len(datasets.load_from_disk(str(dst))) == first.contexts
    assert len(list(dst.glob("data-*.arrow"))) == len(json.loads((dst / "state.json").read_text())["_data_files"])
    with pytest.raises(HsxError, match="holds another export"):
        export_saelens(env["prefill"], dst, column="b3", context_size=5, progress=False)


@pytest.mark.parametrize("kw, message", [
    (dict(column="b6", context_size=4), r"no column holds boundary 6"),
    (dict(column="mid", context_size=4), r"expected a boundary"),
    (dict(column="b3", context_size=0), r"--context-size must be >= 1"),
    (dict(column="b3", context_size=4, dtype="bfloat16"), r"--dtype must be one of"),
])
def test_saelens_refusals(env, tmp_path, kw, message):
    with pytest.raises(HsxError, match=message):
        export_saelens(env["prefill"], tmp_path / "out", progress=False, **kw)


def test_disk_dataset_state_matches_save_to_disk(tmp_path):
    """The state.json hsx writes has the keys and format save_to_disk writes, and files load back."""
    features = datasets.Features({"x": datasets.List(datasets.Value("int64"))})
    ref = datasets.Dataset.from_dict({"x": [[1, 2], [3]]}, features=features).with_format("torch")
    ref.save_to_disk(str(tmp_path / "ref"))
    import pyarrow as pa

    (tmp_path / "mine").mkdir()
    w = DiskDatasetWriter(tmp_path / "mine", features, fingerprint="f00d", format_type="torch", max_file_bytes=1)
    for part in ([[1, 2]], [[3]]):
        w.write(pa.Table.from_pydict({"x": part}, schema=features.arrow_schema))
    assert w.finalize() == 2
    want = json.loads((tmp_path / "ref" / "state.json").read_text())
    got = json.loads((tmp_path / "mine" / "state.json").read_text())
    assert set(got) == set(want) and got["_format_type"] == want["_format_type"] == "torch"
    assert [f["filename"] for f in got["_data_files"]] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    mine = datasets.load_from_disk(str(tmp_path / "mine"))
    assert mine.format["type"] == "torch" and [x.tolist() for x in mine["x"]] == [[1, 2], [3]]


# ---------------------------------------------------------------- CLI

def test_cli_exports(env, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["export", "speculators", str(env["prefill"]), str(tmp_path / "spec"), "-q",
                            "--target-layer-ids", "2,4,5"])
    assert r.exit_code == 0, r.output
    assert "train with --target-layer-ids 2 4 5" in r.output
    r = runner.invoke(app, ["export", "saelens", str(env["prefill"]), str(tmp_path / "sae"), "--column", "b3",
                            "--context-size", "8", "-q"])
    assert r.exit_code == 0, r.output
    assert "contexts x 8 tokens of blocks.3.hook_resid_pre (d_in 64)" in r.output
    r = runner.invoke(app, ["export", "speculators", str(env["final_only"]), str(tmp_path / "bad"), "-q"])
    assert isinstance(r.exception, HsxError) and "boundary 8" in str(r.exception)  # main() prints it, exit 2
    r = runner.invoke(app, ["export", "speculators", str(env["prefill"]), str(tmp_path / "bad2"), "-q",
                            "--target-layer-ids", "two"])
    assert r.exit_code == 2 and "comma-separated integers" in r.output


# ---------------------------------------------------------------- synthetic shards: bad values, short samples

def synthetic(tmp_path, rows: dict[str, torch.Tensor]) -> Path:
    """Prefill shards of a 2-block model with columns b1, b2; sample i has rows[f"s{i}"] in both."""
    from hsx.shards import Manifest, Record, ShardSink, build_metadata

    width = next(iter(rows.values())).shape[1]
    layers = [{"name": f"b{b}", "sources": [b], "width": width, "raw_ids": [b], "rule": "boundary"} for b in (1, 2)]
    meta = build_metadata(layers=layers, dtype="bfloat16", mode="prefill",
                          model={"path": "synthetic", "num_layers": 2, "hidden_size": width},
                          engine={"name": "test"}, dataset={"source": "test"})
    sink = ShardSink(tmp_path / "shards", Manifest(meta))
    for i, (sid, h) in enumerate(rows.items()):
        n = len(h)
        sink.add(Record(sid, i, torch.arange(n) + 3, n, torch.ones(n, dtype=torch.uint8), "prefill",
                        {"b1": h, "b2": h + 1}))
    sink.close()
    return tmp_path / "shards"


def test_non_finite_states_stop_the_exports_with_the_sample_named(tmp_path):
    bad = torch.zeros(4, 8, dtype=torch.bfloat16)
    bad[2, 3] = float("nan")
    src = synthetic(tmp_path, {"good": torch.zeros(5, 8, dtype=torch.bfloat16), "bad": bad})
    with pytest.raises(HsxError, match=r"sample 'bad': non-finite hidden states"):
        export_speculators(src, tmp_path / "spec", target_layer_ids=[1], progress=False)
    with pytest.raises(HsxError, match=r"sample 'bad': non-finite values in column 'b1'"):
        export_saelens(src, tmp_path / "sae", column="b1", context_size=2, progress=False)
    assert not (tmp_path / "sae" / "state.json").exists() and not list((tmp_path / "sae").glob("*.arrow"))
    assert not list((tmp_path / "sae").glob(".*tmp-*"))  # the writer's temp files went with it


def test_float16_output_refuses_values_it_cannot_hold(tmp_path):
    src = synthetic(tmp_path, {"big": torch.full((4, 8), 1e5, dtype=torch.bfloat16)})
    with pytest.raises(HsxError, match=r"sample 'big'.*outside float16's range"):
        export_saelens(src, tmp_path / "sae", column="b1", context_size=2, dtype="float16", progress=False)
    assert export_saelens(src, tmp_path / "sae32", column="b1", context_size=2, progress=False).contexts == 2


def test_speculators_skips_samples_too_short_to_learn_from(tmp_path):
    gen = torch.Generator().manual_seed(0)
    rows = {f"s{i}": torch.randn(n, 8, generator=gen).bfloat16() for i, n in enumerate([3, 1, 2])}
    src = synthetic(tmp_path, rows)
    s = export_speculators(src, tmp_path / "spec", target_layer_ids=[1], progress=False)
    assert (s.samples, s.skipped_short, s.tokens) == (2, 1, 5)
    index = [json.loads(x) for x in (tmp_path / "spec" / "hsx_index.jsonl").read_text().splitlines()]
    assert [e["sample_id"] for e in index] == ["s0", "s2"]
    f = load_file(tmp_path / "spec" / "hidden_states" / "hs_1.safetensors")
    assert torch.equal(bits(f["hidden_states"][:, 0]), bits(rows["s2"]))
    assert torch.equal(bits(f["hidden_states"][:, 1]), bits(rows["s2"] + 1))  # boundary L = 2 last


@pytest.mark.slow
def test_bench_export_runs_and_writes_its_report(tmp_path):
    import math
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, str(root / "scripts/bench_export.py"), "--mb", "2", "--width", "64",
                          "--json", str(out)], env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["data"], r["method"]) for r in runs) == sorted(
        (d, m) for d in ("full", "quarter") for m in ("read", "speculators", "saelens"))
    assert all(math.isfinite(r["mb_per_s"]) and r["mb_per_s"] > 0 and math.isfinite(r["peak_mb"]) for r in runs)


def test_saelens_packer_joins_small_pieces_and_keeps_them_in_order():
    from hsx.export.saelens import _Packer

    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(1 + i % 4, 8, generator=gen) for i in range(3000)]  # samples of 1 to 4 rows
    packer = _Packer(context_size=16, block_contexts=10_000)  # a block far larger than all of them
    for i, p in enumerate(pieces):
        assert packer.push(p, torch.full((len(p),), i)) is None
    assert len(packer.rows) < 3000 // _Packer.JOIN + _Packer.JOIN  # not a tensor per sample held to the end
    rows, tokens = packer.flush()
    whole, owner = torch.cat(pieces), torch.cat([torch.full((len(p),), i) for i, p in enumerate(pieces)])
    k = len(whole) // 16
    assert torch.equal(rows, whole[:k * 16].view(k, 16, 8)) and torch.equal(tokens, owner[:k * 16].view(k, 16))
