"""``--keep``: rows only for chosen positions, exact against a teacher-forced forward, checked by verify."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.eagle3 import Eagle3Dataset
from hsx.errors import HsxError
from hsx.config import ExtractConfig
from hsx.shards import positions
from oracle import oracle_sources
from shard_fixtures import finite_records, make_metadata, write_sink

torch.set_num_threads(1)
ROWS = [
    {"id": "chat", "messages": [{"role": "user", "content": "How do tides work?"},
                                {"role": "assistant", "content": "The Moon pulls on the oceans."},
                                {"role": "user", "content": "And the Sun?"},
                                {"role": "assistant", "content": "It pulls too, less."}]},
    {"id": "text", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "short", "text": "Bees"},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep_model")
    tok = build_demo_tokenizer()
    m = build_tiny_llama(num_layers=3, hidden_size=32, vocab_size=len(tok), seed=4,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    m.save_pretrained(root)
    tok.save_pretrained(root)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"dir": str(root), "model": m, "data": str(data)}


def run(model, out: Path, mode: str, keep: str):
    args = ["extract", "--model", model["dir"], "--dataset", model["data"], "--output", str(out), "--id-field", "id",
            "--layers", "final,eagle3,1", "--dtype", "float32", "--mode", mode, "--keep", keep,
            "--max-new-tokens", "5", "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return hsx.open(out)


def expected_positions(keep: str, mode: str, n: int, prompt_len: int, loss_mask: np.ndarray) -> np.ndarray:
    """The rule written out per case, independently of hsx.shards.positions."""
    last = n - 2 if mode == "generate" else n - 1
    if keep == "all":
        return np.arange(last + 1)
    if keep == "last":
        return np.array([last]) if last >= 0 else np.zeros(0, np.int64)
    if keep == "completion":
        return np.arange(prompt_len - 1, n - 1)
    return np.flatnonzero(loss_mask[1:] == 1)  # loss: the next token is learned


CASES = [("generate", "completion"), ("generate", "loss"), ("generate", "last"), ("prefill", "loss"),
         ("prefill", "last")]


@pytest.mark.parametrize("mode,keep", CASES)
def test_kept_rows_are_the_teacher_forced_states_at_the_kept_positions(model, tmp_path, mode, keep):
    ds = run(model, tmp_path / "out", mode, keep)
    assert ds.metadata["keep"] == keep
    stored = 0
    for s in ds:
        ids = s.input_ids.long()
        want_pos = expected_positions(keep, mode, len(ids), s.prompt_len, s.loss_mask.numpy())
        assert np.array_equal(s.positions.numpy(), want_pos), s.sample_id
        ref = oracle_sources(model["model"], ids)
        for g in ds.metadata["layers"]:
            want = torch.cat([ref[src] for src in g["sources"]], dim=-1)[torch.from_numpy(want_pos)]
            got = s.hidden(g["name"])
            assert got.shape == want.shape, (s.sample_id, g["name"])
            if len(want_pos):
                assert (got - want).abs().max().item() <= 1e-4, (s.sample_id, g["name"])
        stored += len(want_pos)
    assert stored > 0
    tm = ds.tokens("final")
    assert tm.hidden.shape[0] == stored
    for i, s in enumerate(ds):
        assert torch.equal(tm.position[tm.sample_index == i], s.positions)
    runner = CliRunner()
    assert runner.invoke(app, ["verify", str(tmp_path / "out")]).exit_code == 0

    info = json.loads(runner.invoke(app, ["inspect", "--json", str(tmp_path / "out")]).output)
    row_bytes = sum(g["row_bytes"] for g in ds.metadata["layers"])
    covered = sum(len(s.input_ids) - (mode == "generate") for s in ds)
    assert info["keep"] == keep and info["rows_per_column"] == stored and info["rows_covered"] == covered
    assert info["bytes_saved"] == (covered - stored) * row_bytes > 0
    text = runner.invoke(app, ["inspect", str(tmp_path / "out")]).output
    assert f"keep {keep} ({stored:,} of {covered:,} rows;" in text


def test_keep_all_is_the_default_and_stores_every_covered_row(model, tmp_path):
    assert ExtractConfig().keep == "all"
    ds = run(model, tmp_path / "out", "generate", "all")
    for s in ds:
        assert torch.equal(s.positions, torch.arange(len(s.input_ids) - 1))


def test_keep_completion_in_prefill_mode_is_refused_with_the_reason():
    cfg = ExtractConfig(model="m", dataset="d", output="o", mode="prefill", keep="completion")
    with pytest.raises(HsxError, match="completion needs generate mode.*use loss"):
        cfg.validate()
    with pytest.raises(HsxError, match="--keep must be one of all, completion, loss, last; got 'first'"):
        ExtractConfig(model="m", dataset="d", output="o", keep="first").validate()


def test_verify_finds_rows_that_do_not_follow_the_keep_rule(tmp_path):
    meta = make_metadata([4], mode="prefill")
    write_sink(tmp_path / "ok", meta, finite_records(meta, [4, 5]))
    # a shard that says it keeps the last row but holds every row
    meta_last = {**meta, "keep": "last"}
    write_sink(tmp_path / "bad", meta_last, finite_records(meta, [4, 5]))
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "bad")])
    assert result.exit_code == 1
    assert "4 rows of 'l0' for 4 tokens; prefill mode covers positions 0..N-1, keep='last' stores (1 rows)" in result.output
    with pytest.raises(HsxError, match="keep='last'"):
        hsx.open(tmp_path / "bad").tokens("l0")


def test_eagle3_training_refuses_shards_without_every_row(model, tmp_path):
    ds = run(model, tmp_path / "out", "prefill", "last")
    with pytest.raises(HsxError, match="keep only 'last' positions"):
        Eagle3Dataset(ds)


def test_position_rules_on_many_samples_at_once():
    n = np.array([1, 4, 6, 2])
    prompt = np.array([1, 2, 3, 2])
    mask = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1], dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(n)])
    for keep in positions.KEEP:
        for mode in ("generate", "prefill"):
            if keep == "completion" and mode == "prefill":
                continue
            owner, pos = positions.kept(keep, mode, n, prompt, mask, offsets)
            for j in range(len(n)):
                want = expected_positions(keep, mode, n[j], prompt[j], mask[offsets[j]:offsets[j + 1]])
                assert np.array_equal(pos[owner == j], want), (keep, mode, j)


# --- verify --recompute under --keep --------------------------------------------------------------

@pytest.fixture(scope="module")
def kept_outputs(model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kept")
    return {case: run(model, root / "-".join(case), *case) and root / "-".join(case) for case in CASES}


def recompute_json(path: Path) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["verify", str(path), "--recompute", "--json"])
    return result.exit_code, json.loads(result.stdout)["recompute"]


def states_at(model, ids: torch.Tensor, sources, pos: torch.Tensor) -> torch.Tensor:
    """The oracle's rows of a column with these ``sources`` at positions ``pos`` [R]."""
    ref = oracle_sources(model["model"], ids.long())
    return torch.cat([ref[src] for src in sources], dim=-1)[pos]


@pytest.mark.parametrize("mode,keep", CASES)
def test_recompute_checks_kept_rows_at_their_positions(kept_outputs, mode, keep):
    code, r = recompute_json(kept_outputs[(mode, keep)])
    assert code == 0, [f["message"] for s in r["samples"] for f in s["findings"]]
    stored = sum(s.num_rows for s in hsx.open(kept_outputs[(mode, keep)]))
    assert r["ok"] and r["rows"] == stored > 0 and len(r["samples"]) == len(ROWS)


def _faults(model, fault: str, shift: int):
    """An ``edit`` for ``shard_fixtures.rewrite``: the stored rows of one sample replaced by what a
    misaligned writer would have kept at those positions; returns (edit, faulty sample, rows changed)."""
    changed = {}
    donor = {}
    target = "text" if fault == "sample" else "chat"

    def edit(k, s, hidden):
        if fault == "sample" and s.sample_id == "chat":
            donor["ids"] = s.input_ids.long().clone()
        if s.sample_id != target:
            return
        pos = s.positions
        for g in s._shard.metadata["layers"]:
            if fault == "shift":  # each kept row holds the state of position p + shift
                moved = ((pos + shift >= 0) & (pos + shift < len(s.input_ids))).nonzero()[:, 0]
                rows = states_at(model, s.input_ids, g["sources"], pos[moved] + shift)
            elif fault == "sample":  # the rows of another sample (chat, the longest) at the same positions
                moved = (pos < len(donor["ids"])).nonzero()[:, 0]
                rows = states_at(model, donor["ids"], g["sources"], pos[moved])
            elif fault == "repeat":  # rows dropped, padded with copies of the stored row before them: the
                # first rows after a gap between kept positions where there is one (a turn boundary)
                gaps = (pos[1:] != pos[:-1] + 1).nonzero()[:, 0] + 1
                start = int(gaps[0]) if len(gaps) else len(pos) - 3
                moved = torch.arange(start, start + 3)
                rows = hidden[g["name"]][start - 1].expand(3, -1)
            elif g["name"] == "b1":  # the neighbouring boundary's states at the right positions
                moved = torch.arange(len(pos))
                rows = states_at(model, s.input_ids, [2], pos)
            else:
                continue
            h = hidden[g["name"]]
            before = h[moved].clone()
            h[moved] = rows.to(h.dtype)
            width = h.shape[1] // len(g["sources"])
            for k, src in enumerate(g["sources"]):  # rows whose state really moved (not a shared prefix)
                part = slice(k * width, (k + 1) * width)
                diff = (h[moved, part] - before[:, part]).norm(dim=-1) > 1e-3 * before[:, part].norm(dim=-1)
                changed[(g["name"], src)] = int(diff.sum())

    return edit, target, changed


FAULTS = [("shift", 1), ("shift", -1), ("sample", 0), ("layer", 0), ("repeat", 0)]


@pytest.mark.parametrize("fault,shift", FAULTS)
@pytest.mark.parametrize("mode,keep", CASES)
def test_recompute_diagnoses_misplaced_kept_rows(model, kept_outputs, tmp_path, mode, keep, fault, shift):
    from shard_fixtures import rewrite

    if (mode, keep, fault, shift) == ("prefill", "last", "shift", 1):
        pytest.skip("the last prefill position has no position after it")
    if fault == "repeat" and keep == "last":
        pytest.skip("one row per sample: no row before it to copy")
    edit, target, changed = _faults(model, fault, shift)
    code, r = recompute_json(rewrite(kept_outputs[(mode, keep)], tmp_path / "faulty", edit))
    assert changed and max(changed.values()) >= 1
    assert code == 1 and not r["ok"]
    assert {s["sample_id"] for s in r["samples"] if s["findings"]} == {target}
    s = next(s for s in r["samples"] if s["sample_id"] == target)
    assert s["verdict"] == "misaligned"
    findings = s["findings"]
    want = {"shift": f"position p{shift:+d}", "sample": "sample 'chat'", "layer": "boundary 2", "repeat": "repeat"}[fault]
    ds = hsx.open(kept_outputs[(mode, keep)])
    ids = {x.sample_id: x.input_ids.tolist() for x in ds}
    for f in findings:
        if f["matched"] != want:  # boundary 0 is the token's embedding: any position of the same token fits
            assert f["source"] == 0 and f["kind"] in ("position", "sample"), f["message"]
            d = int(f["message"].split("shifted by ")[1].rstrip(")")) if f["kind"] == "position" else 0
            held = ids["chat"][f["first"]] if fault == "sample" else ids[target][f["first"] + shift]
            matched = ids[target if f["kind"] == "position" else "chat"][f["first"] + d]
            assert held == matched, f["message"]
    assert want in {f["matched"] for f in findings}
    flagged = {}
    for f in findings:
        flagged[(f["column"], f["source"])] = flagged.get((f["column"], f["source"]), 0) + f["rows"]
    positions_of = set(ds.select([target])[0].positions.tolist())
    assert all(f["first"] in positions_of and f["last"] in positions_of for f in findings)  # positions, not row numbers
    for key, n in changed.items():  # float32 rows: every moved row of every column source is caught
        assert flagged.get(key, 0) == n, (key, flagged, changed)


def test_a_chat_with_nothing_to_learn_is_stored_without_rows_and_counted(model, tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [ROWS[0], {"id": "ask", "messages": [{"role": "user", "content": "Is anyone there?"}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["extract", "--model", model["dir"], "--dataset", str(data), "--output", str(tmp_path / "out"),
            "--id-field", "id", "--layers", "final", "--mode", "prefill", "--keep", "loss"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "no rows: 1 samples stored with no hidden rows" in result.output
    ds = hsx.open(tmp_path / "out")
    assert ds["ask"].hidden("final").shape[0] == 0 and ds["ask"].loss_mask.sum() == 0
    assert ds["chat"].hidden("final").shape[0] == int(ds["chat"].loss_mask.sum())
