"""EAGLE3 feeding: hsx's Dataset/collate/shift against SpecForge 0.2.0's own reader and
normalisation (bit-exact), the exported states against an independent forward, refusals,
idempotent and path-safe export, the draft vocabulary, the CLI, and the training example."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.eagle3 import Eagle3Dataset, check_eagle3_layout, collate, count_loss_tokens, shift_for_draft, vocab_mapping
from hsx.export.specforge import export_specforge, relative_path
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from oracle import oracle_sources

NUM_LAYERS, HIDDEN = 8, 64
BOUNDARIES = [2, 4, 5]  # SGLang default [2, L//2, L-3] for L = 8

ROWS = [
    {"id": "chat-a", "messages": [{"role": "user", "content": "How do tides work?"},
                                  {"role": "assistant", "content": "The Moon pulls on the oceans."}]},
    {"id": "share-b", "conversations": [{"from": "human", "value": "What is bread made of?"},
                                        {"from": "gpt", "value": "Flour, water, salt and yeast."},
                                        {"from": "human", "value": "And butter?"},
                                        {"from": "gpt", "value": "Butter is made from cream."}]},
    {"id": "text-c", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "chat-d", "messages": [{"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": "Blue, like the sky on a clear day in June."}]},
    {"id": "../../escape", "text": "A sample id that looks like a path."},
    {"id": "/abs/id", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eagle3")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=HIDDEN, vocab_size=len(tok), seed=3,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = write_jsonl(root / "data.jsonl", ROWS)
    out = {"root": root, "model": target, "target": str(root / "target")}
    for name, kw in (("prefill", dict(mode="prefill")), ("generate", dict(mode="generate", max_new_tokens=10)),
                     ("final_only", dict(mode="prefill", layers="final"))):
        cfg = dict(model=str(root / "target"), dataset=data, output=str(root / name), id_field="id",
                   layers="final,eagle3", batch_size=4, max_shard_samples=4)
        cfg.update(kw)
        extract(ExtractConfig(**cfg), progress=False)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def exported(env) -> dict:
    dst = {}
    for mode in ("prefill", "generate"):
        dst[mode] = env["root"] / f"sf_{mode}"
        export_specforge(env[mode], dst[mode], draft_vocab_size=40, progress=False)
    return dst


def specforge_samples(dst: Path, max_len: int = 4096) -> dict[str, dict]:
    """Every file under ``dst`` through SpecForge's reader, feature store and normaliser, by relative path."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    refs = OfflineManifestReader(str(dst), validate_files=True, max_len=max_len).read()
    store = LocalFeatureStore()
    out = {}
    for ref in refs:
        raw, _ = store.get(ref)
        path = Path(ref.feature_store_uri[len("file://"):])
        out[path.relative_to(dst.resolve()).as_posix()] = {"raw": raw, "norm": normalize_offline_sample(raw, max_len),
                                                           "specs": ref.feature_specs}
    return out


def index_of(dst: Path) -> list[dict]:
    return [json.loads(line) for line in (dst / "hsx_index.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- SpecForge's reader, bit-exact

@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_specforge_reader_sees_exactly_hsx_samples(env, exported, mode):
    dst = exported[mode]
    ds = Eagle3Dataset(env[mode])
    sf = specforge_samples(dst)
    index = index_of(dst)
    assert sorted(sf) == sorted(e["file"] for e in index) and len(index) == len(ds) == len(ROWS)
    shards = hsx.open(env[mode])
    for e in index:
        mine, theirs = ds[e["index"]], sf[e["file"]]
        assert e["sample_id"] == mine["sample_id"] == shards[e["index"]].sample_id
        raw = theirs["raw"]
        assert set(raw) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert raw["input_ids"].dtype == torch.int64 and raw["loss_mask"].dtype == torch.int64
        assert raw["hidden_state"].dtype == raw["aux_hidden_state"].dtype == torch.bfloat16
        t = len(mine["input_ids"])
        n = len(shards[e["index"]].input_ids)
        assert t == (n - 1 if mode == "generate" else n) == e["tokens"]
        assert raw["hidden_state"].shape == (1, t, HIDDEN) and raw["aux_hidden_state"].shape == (1, t, 3 * HIDDEN)
        assert torch.equal(raw["input_ids"], mine["input_ids"]) and torch.equal(raw["loss_mask"], mine["loss_mask"])
        assert torch.equal(raw["hidden_state"][0].view(torch.int16), mine["hidden_state"].view(torch.int16))
        assert torch.equal(raw["aux_hidden_state"][0].view(torch.int16), mine["aux_hidden_state"].view(torch.int16))
        # SpecForge's normalised sample == hsx's collate of that one sample
        norm, batch = theirs["norm"], collate([mine])
        assert torch.equal(norm["input_ids"], batch["input_ids"])
        assert torch.equal(norm["loss_mask"], batch["loss_mask"])
        assert torch.equal(norm["attention_mask"], batch["attention_mask"])
        assert torch.equal(norm["hidden_state"].view(torch.int16), batch["aux_hidden_state"].view(torch.int16))
        assert torch.equal(norm["target"].view(torch.int16), batch["hidden_state"].view(torch.int16))
        # the files need no pickle beyond tensors: weights_only loading works
        safe = torch.load(dst / e["file"], weights_only=True)
        assert torch.equal(safe["aux_hidden_state"].view(torch.int16), raw["aux_hidden_state"].view(torch.int16))


def test_batch_and_shift_match_specforge_collator_and_target_head(env, exported):
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.modeling.target.target_head import TargetHead

    dst = exported["prefill"]
    sf = specforge_samples(dst)
    ds = Eagle3Dataset(env["prefill"])
    index = index_of(dst)
    mine = [ds[e["index"]] for e in index]
    lens = {len(m["input_ids"]) for m in mine}
    assert len(lens) > 1  # padding is exercised
    theirs = DataCollatorWithPadding()([sf[e["file"]]["norm"] for e in index])
    batch = collate(mine)
    assert torch.equal(theirs["input_ids"], batch["input_ids"])
    assert torch.equal(theirs["attention_mask"], batch["attention_mask"])
    assert torch.equal(theirs["loss_mask"], batch["loss_mask"])
    assert torch.equal(theirs["hidden_state"].view(torch.int16), batch["aux_hidden_state"].view(torch.int16))
    assert torch.equal(theirs["target"].view(torch.int16), batch["hidden_state"].view(torch.int16))
    # the shift: TargetHead.preprocess does not use the head's weights
    ids, target, loss_mask = TargetHead.preprocess(None, theirs["input_ids"], theirs["target"], theirs["loss_mask"])
    view = shift_for_draft(batch)
    assert torch.equal(ids, view["input_ids"])
    assert torch.equal(target.view(torch.int16), view["target_hidden_state"].view(torch.int16))
    assert torch.equal(loss_mask[..., 0], view["loss_mask"])
    # and what the shift means: position t gets token t+1 and the final state after token t+1
    for k, m in enumerate(mine):
        t = len(m["input_ids"])
        assert torch.equal(view["input_ids"][k, : t - 1], m["input_ids"][1:])
        assert torch.equal(view["target_hidden_state"][k, : t - 1], m["hidden_state"][1:])
        assert view["loss_mask"][k, t - 1 :].sum() == 0


@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_exported_states_are_an_independent_forward(env, exported, mode):
    """Row t of a file == the teacher-forced state after token t (bf16 rounding of an fp32 forward)."""
    shards = hsx.open(env[mode])
    for e in index_of(exported[mode]):
        raw = torch.load(exported[mode] / e["file"], weights_only=True)
        ref = oracle_sources(env["model"], shards[e["index"]].input_ids)
        t = e["tokens"]
        aux = torch.cat([ref[b] for b in BOUNDARIES], dim=-1)[:t]
        torch.testing.assert_close(raw["aux_hidden_state"][0].float(), aux, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(raw["hidden_state"][0].float(), ref["final"][:t], rtol=1e-2, atol=1e-3)
        if t > 1:  # a shift by one row would not pass: neighbouring states differ by far more
            assert (raw["hidden_state"][0, 1:].float() - ref["final"][: t - 1]).abs().max() > 0.05


def test_dataset_is_zero_copy_and_truncates(env):
    shards = hsx.open(env["prefill"])
    ds = Eagle3Dataset(shards)
    s = ds[1]
    assert s["aux_hidden_state"].data_ptr() == shards[1].hidden("eagle3").data_ptr()
    assert s["hidden_state"].data_ptr() == shards[1].hidden("final").data_ptr()
    short = Eagle3Dataset(shards, max_len=5)[1]
    assert len(short["input_ids"]) == 5 and short["aux_hidden_state"].shape == (5, 3 * HIDDEN)
    f32 = Eagle3Dataset(shards, dtype=torch.float32)[1]
    assert f32["hidden_state"].dtype == torch.float32 and torch.equal(f32["hidden_state"], s["hidden_state"].float())


# ---------------------------------------------------------------- refusals

def test_shards_without_eagle3_are_refused(env, tmp_path):
    with pytest.raises(HsxError, match=r"missing \['eagle3'\].*found \['final'\]"):
        Eagle3Dataset(env["final_only"])
    with pytest.raises(HsxError, match="eagle3"):
        export_specforge(env["final_only"], tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_draft_config_checks(env):
    meta = hsx.open(env["prefill"]).metadata
    ok = {"hidden_size": 32, "target_hidden_size": HIDDEN, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    assert check_eagle3_layout(meta, ok).aux_boundaries == tuple(BOUNDARIES)
    # no ids: SpecForge's default [1, L//2-1, L-4] -> +1 -> [2, 4, 5]
    assert check_eagle3_layout(meta, {"hidden_size": HIDDEN}).hidden_size == HIDDEN
    with pytest.raises(HsxError, match=r"target_hidden_size=128 expects 'final' width 128 and 'eagle3' width 384; the shards have 64 and 192"):
        check_eagle3_layout(meta, {**ok, "target_hidden_size": 128})
    with pytest.raises(HsxError, match=r"hidden_size=32 expects"):
        check_eagle3_layout(meta, {"hidden_size": 32})  # no target_hidden_size: hidden_size is the target's
    with pytest.raises(HsxError, match=r"\[1, 3, 6\] -> boundaries \[2, 4, 7\].*holds boundaries \[2, 4, 5\]"):
        check_eagle3_layout(meta, {**ok, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}})
    with pytest.raises(HsxError, match="3 aux layer ids"):
        check_eagle3_layout(meta, {**ok, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}})
    # a head that names its rule (hsx export vllm-head writes vLLM's: boundary = id) is read by that rule
    vllm_ids = {"eagle_aux_hidden_state_layer_ids": BOUNDARIES}
    marked = {**ok, "eagle_config": vllm_ids, "hsx": {"aux_layer_ids_rule": "vllm", "aux_boundaries": BOUNDARIES}}
    assert check_eagle3_layout(meta, marked).aux_boundaries == tuple(BOUNDARIES)
    with pytest.raises(HsxError, match=r"boundaries \[3, 5, 6\]"):  # the same ids unmarked: SGLang's + 1
        check_eagle3_layout(meta, {**ok, "eagle_config": vllm_ids})
    sglang_marked = {**ok, "hsx": {"aux_layer_ids_rule": "sglang"}}
    assert check_eagle3_layout(meta, sglang_marked).aux_boundaries == tuple(BOUNDARIES)
    with pytest.raises(HsxError, match=r"read by the vllm rule.*= boundaries \[1, 3, 4\]"):
        check_eagle3_layout(meta, {**ok, "hsx": {"aux_layer_ids_rule": "vllm"}})
    bad = json.loads(json.dumps(meta))
    next(g for g in bad["layers"] if g["name"] == "eagle3")["width"] = 3 * HIDDEN + 3
    with pytest.raises(HsxError, match="not 3 x the 'final' width"):
        check_eagle3_layout(bad)
    # hyper-connection streams: each aux boundary is hc_mult x hidden_size wide, final one stream
    hc = json.loads(json.dumps(meta))
    hc["model"]["hc_mult"] = 4
    with pytest.raises(HsxError, match=r"'eagle3' width 192 is not 3 x 4 \(hyper-connection streams\) x the 'final' width 64"):
        check_eagle3_layout(hc)
    next(g for g in hc["layers"] if g["name"] == "eagle3")["width"] = 12 * HIDDEN
    assert check_eagle3_layout(hc).aux_width == 12 * HIDDEN


def test_export_refuses_draft_config_mismatch(env, tmp_path):
    cfg = tmp_path / "draft"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "vocab_size": 600, "draft_vocab_size": 32,
                                                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 4]}}))
    with pytest.raises(HsxError, match=r"boundaries \[1, 4, 5\]"):
        export_specforge(env["prefill"], tmp_path / "x", draft_config=cfg, progress=False)
    (cfg / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "vocab_size": 600, "draft_vocab_size": 32}))
    s = export_specforge(env["prefill"], tmp_path / "y", draft_config=cfg, progress=False)
    assert (s.draft_vocab_size, s.target_vocab_size) == (32, 600)
    vm = torch.load(tmp_path / "y" / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    assert vm["t2d"].shape == (600,) and vm["d2t"].shape == (32,)


# ---------------------------------------------------------------- idempotence and paths

def test_reexport_skips_complete_files_and_replaces_broken_ones(env, tmp_path):
    dst = tmp_path / "sf"
    first = export_specforge(env["prefill"], dst, draft_vocab_size=40, progress=False)
    assert (first.written, first.skipped) == (len(ROWS), 0)
    files = sorted(dst.glob("rows_*/data_*.ckpt"))
    before = {p: p.stat().st_mtime_ns for p in files}
    vocab_mtime = (dst / "vocab_mapping" / "vocab_mapping.pt").stat().st_mtime_ns
    again = export_specforge(env["prefill"], dst, draft_vocab_size=40, progress=False)
    assert (again.written, again.skipped) == (0, len(ROWS))
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert (dst / "vocab_mapping" / "vocab_mapping.pt").stat().st_mtime_ns == vocab_mtime
    # a truncated file and a crash's temp file: the first is replaced, the second removed
    victim = dst / relative_path(2)
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 2])
    tmp = victim.with_name(f".{victim.name}.tmp-99999")
    tmp.write_bytes(b"partial")
    # a whole file holding another sample's tokens is not "complete" either
    other = dst / relative_path(3)
    other.write_bytes((dst / relative_path(0)).read_bytes())
    third = export_specforge(env["prefill"], dst, draft_vocab_size=40, progress=False)
    assert (third.written, third.replaced, third.skipped) == (2, 2, len(ROWS) - 2)
    assert victim.read_bytes() == good and not tmp.exists()
    assert not list(dst.rglob("*.tmp-*"))
    for p in files:
        if p not in (victim, other):
            assert p.stat().st_mtime_ns == before[p]
    # a destination holding another source's export is refused, not mixed
    with pytest.raises(HsxError, match="other shards"):
        export_specforge(env["generate"], dst, draft_vocab_size=40, progress=False)


def test_paths_cannot_escape_destination(env, tmp_path):
    dst = tmp_path / "sf"
    export_specforge(env["prefill"], dst, draft_vocab_size=40, progress=False)
    written = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())
    assert written == sorted([relative_path(i).as_posix() for i in range(len(ROWS))]
                             + ["hsx_export.json", "hsx_index.jsonl", "vocab_mapping/vocab_mapping.pt"])
    assert not (tmp_path / "escape").exists() and not Path("/abs/id").exists()
    ids = {e["sample_id"]: e["file"] for e in index_of(dst)}
    assert ids["../../escape"].startswith("rows_0-2000/data_") and ids["/abs/id"].startswith("rows_0-2000/data_")
    # a rows directory that is a symlink to elsewhere is refused
    outside = tmp_path / "outside"
    outside.mkdir()
    dst2 = tmp_path / "sf2"
    dst2.mkdir()
    (dst2 / "hsx_export.json").write_text((dst / "hsx_export.json").read_text())
    os.symlink(outside, dst2 / "rows_0-2000")
    with pytest.raises(HsxError, match="symbolic link"):
        export_specforge(env["prefill"], dst2, draft_vocab_size=40, progress=False)
    assert list(outside.iterdir()) == []


def test_group_directories():
    assert relative_path(0).as_posix() == "rows_0-2000/data_0.ckpt"
    assert relative_path(1999).as_posix() == "rows_0-2000/data_1999.ckpt"
    assert relative_path(2000).as_posix() == "rows_2000-4000/data_2000.ckpt"


# ---------------------------------------------------------------- draft vocabulary

def test_vocab_mapping_matches_specforge_definition():
    from specforge.data.preprocessing import process_token_dict_to_mappings

    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, 50, (400,), generator=gen) ** 2 % 97, minlength=120)
    counts[7] = counts[11] = counts.max()  # ties at the top
    for draft_size in (1, 10, 30, 120):
        d2t, t2d = vocab_mapping(counts, draft_size)
        # SpecForge breaks ties by insertion order: insert in ascending id order to match ours
        token_dict = Counter({i: int(c) for i, c in enumerate(counts.tolist()) if c > 0})
        ref_d2t, ref_t2d = process_token_dict_to_mappings(token_dict, draft_size, len(counts))
        assert torch.equal(d2t, ref_d2t) and torch.equal(t2d, ref_t2d), draft_size
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
        assert int(t2d.sum()) == draft_size
        target_ids = torch.arange(draft_size) + d2t
        assert torch.equal(target_ids, torch.nonzero(t2d).flatten())  # draft id -> target id, sorted
        kept_min = counts[t2d].min()
        assert (counts[~t2d] <= kept_min).all()  # nothing dropped is more frequent than what is kept
    with pytest.raises(HsxError, match="1..120"):
        vocab_mapping(counts, 121)


def test_exported_vocab_mapping_counts_learned_tokens(env, exported):
    shards = hsx.open(env["generate"])
    vocab = json.loads((Path(env["target"]) / "config.json").read_text())["vocab_size"]
    counts = count_loss_tokens(((s.input_ids, s.loss_mask) for s in shards), vocab)
    # generate mode: the last completion token (no state, not in the files) is still counted
    assert int(counts.sum()) == sum(int(s.loss_mask.sum()) for s in shards)
    vm = torch.load(exported["generate"] / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    d2t, t2d = vocab_mapping(counts, 40)
    assert torch.equal(vm["d2t"], d2t) and torch.equal(vm["t2d"], t2d)
    assert vm["t2d"].shape == (vocab,) and int(vm["t2d"].sum()) == 40
    top = torch.argsort(counts, descending=True, stable=True)[:5]
    assert t2d[top].all()


# ---------------------------------------------------------------- CLI

def test_cli_export(env, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["export", "specforge", str(env["generate"]), str(tmp_path / "sf"), "--draft-vocab-size", "16", "-q"])
    assert result.exit_code == 0, result.output
    assert f"{len(ROWS)} samples" in result.output and "draft vocab 16 of" in result.output
    assert len(list((tmp_path / "sf").glob("rows_0-2000/data_*.ckpt"))) == len(ROWS)
    result = runner.invoke(app, ["export", "specforge", str(env["generate"]), str(tmp_path / "sf"), "--draft-vocab-size", "16", "-q"])
    assert result.exit_code == 0 and f"{len(ROWS)} already complete" in result.output


def test_cli_refusal_exits_2(env, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "from hsx.cli import main; main()", "export", "specforge",
                           str(env["final_only"]), str(tmp_path / "sf"), "-q"], capture_output=True, text=True)
    assert proc.returncode == 2 and "error:" in proc.stderr and "eagle3" in proc.stderr


# ---------------------------------------------------------------- training example

def test_training_example_loss_decreases(env):
    path = Path(__file__).resolve().parents[1] / "scripts" / "train_eagle3_demo.py"
    spec = importlib.util.spec_from_file_location("train_eagle3_demo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.run(str(env["prefill"]), steps=30, batch=4, lr=3e-3, held_out=0.34, log_every=0,
                draft_config={"target_hidden_size": HIDDEN, "hidden_size": HIDDEN, "norm_before_fc": True})
    assert r["norm_before_fc"] is True and r["samples"]["held_out"] == 2
    k = [key for key in r["loss"] if key.startswith("mean_last")][0]
    assert r["loss"][k] < 0.9 * r["loss"][k.replace("last", "first")]
    assert 0.0 <= r["held_out_top1"]["trained"]["top1"] <= 1.0 and r["held_out_top1"]["trained"]["positions"] > 0
