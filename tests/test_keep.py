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
