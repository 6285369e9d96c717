"""hsx extract end to end: every stored row against an independent teacher-forced forward,
bad inputs as error records, resume after SIGKILL, config refusal, prefill loss masks, CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from hsx.shards.manifest import load_manifest
import held_run
from oracle import oracle_sources

NUM_LAYERS = 8

GOOD_ROWS = [
    {"id": "chat-a", "messages": [{"role": "user", "content": "How do tides work?"},
                                  {"role": "assistant", "content": "The Moon pulls on the oceans."}]},
    {"id": "chat-b", "messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Name a colour."}]},
    {"id": "share-c", "conversations": [{"from": "human", "value": "What is bread made of?"},
                                        {"from": "gpt", "value": "Flour, water, salt and yeast."},
                                        {"from": "human", "value": "And butter?"},
                                        {"from": "gpt", "value": "Butter is made from cream."}]},
    {"id": "text-d", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "text-e", "text": "Bees"},
    {"id": "text-f", "text": "A longer line of plain text, so that the batch holds prompts of rather different lengths, "
                             "which is where padding mistakes show up."},
]
BAD_ROWS = [
    ({"id": "bad-empty", "text": "   "}, "empty"),
    ({"id": "bad-turn", "messages": [{"role": "user"}]}, "content"),
    ({"id": "bad-role", "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"id": "bad-type", "messages": "not a list"}, "list"),
    ({"id": "bad-missing"}, "missing"),
    ({"id": "bad-long", "text": "word " * 400}, "max_length"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=len(tok), seed=1,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draft = make_layerskip_draft(target, num_layers=2)
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": target, "tok": tok}


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def check_against_oracle(ds, model, mode: str) -> int:
    checked = 0
    for s in ds:
        ids = s.input_ids.long()
        ref = oracle_sources(model, ids)
        rows = len(ids) - 1 if mode == "generate" else len(ids)
        assert s.num_rows == rows, s.sample_id
        for g in ds.metadata["layers"]:
            want = torch.cat([ref[src] for src in g["sources"]], dim=-1)[:rows]
            got = s.hidden(g["name"]).float()
            assert got.shape == want.shape, (s.sample_id, g["name"])
            diff = (got - want).abs().max().item() if rows else 0.0
            assert diff <= 1e-4, f"{s.sample_id} {g['name']}: max |diff| {diff}"
            checked += rows
    return checked


def config(models, data: str, out: Path, **kw) -> ExtractConfig:
    base = dict(model=models["target"], dataset=data, output=str(out), id_field="id", dtype="float32",
                layers="final,eagle3,0,8", max_new_tokens=12, batch_size=4)
    base.update(kw)
    return ExtractConfig(**base)


@pytest.mark.parametrize("topk,draft_tokens", [(None, None), (1, 4), (4, 8)])
def test_generate_rows_match_teacher_forced_forward(models, tmp_path, topk, draft_tokens):
    data = write_jsonl(tmp_path / "data.jsonl", GOOD_ROWS)
    spec = {} if topk is None else dict(draft_model=models["draft"], spec_num_steps=3, spec_topk=topk,
                                         spec_num_draft_tokens=draft_tokens)
    summary = extract(config(models, data, tmp_path / "out", **spec), progress=False)
    assert summary.samples == len(GOOD_ROWS) and summary.errors == 0
    ds = hsx.open(tmp_path / "out")
    assert ds.sample_ids == [r["id"] for r in GOOD_ROWS]
    assert check_against_oracle(ds, models["model"], "generate") > 0
    for s in ds:
        completion = len(s.input_ids) - s.prompt_len
        assert s.loss_mask.sum().item() == completion
        if topk is None:
            assert s.accept_lens is None
        else:
            a = s.accept_lens.long()
            assert a.sum().item() >= completion - 1 and (a >= 1).all()


def test_speculative_tokens_equal_plain_greedy(models, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", GOOD_ROWS)
    extract(config(models, data, tmp_path / "plain", layers="final"), progress=False)
    extract(config(models, data, tmp_path / "spec", layers="final", draft_model=models["draft"], spec_topk=4,
                   spec_num_draft_tokens=6), progress=False)
    plain, spec = hsx.open(tmp_path / "plain"), hsx.open(tmp_path / "spec")
    for a, b in zip(plain, spec):
        assert torch.equal(a.input_ids, b.input_ids), a.sample_id


def test_prefill_mode_rows_and_loss_mask(models, tmp_path):
    hollow = {"id": "hollow", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}
    data = write_jsonl(tmp_path / "data.jsonl", [*GOOD_ROWS, hollow])
    summary = extract(config(models, data, tmp_path / "out", mode="prefill"), progress=False)
    assert summary.samples == len(GOOD_ROWS) and summary.errors == 1
    ds = hsx.open(tmp_path / "out")
    assert [(e.sample_id, "assistant turn is empty" in e.reason) for e in ds.errors] == [("hollow", True)]
    assert check_against_oracle(ds, models["model"], "prefill") > 0
    tok = models["tok"]
    by_id = {s.sample_id: s for s in ds}
    share = by_id["share-c"]
    learned = tok.decode(share.input_ids[share.loss_mask.bool()].tolist())
    assert "Flour, water, salt and yeast." in learned and "Butter is made from cream." in learned
    assert "bread" not in learned and "butter?" not in learned
    text = by_id["text-d"]  # plain text: every token is learned but the BOS the tokenizer adds
    assert int(text.input_ids[0]) == tok.bos_token_id
    assert text.loss_mask[0] == 0 and text.loss_mask[1:].all()


def test_bad_inputs_become_error_records(models, tmp_path):
    rows = [GOOD_ROWS[0], *(r for r, _ in BAD_ROWS), GOOD_ROWS[3]]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    summary = extract(config(models, data, tmp_path / "out", max_length=200), progress=False)
    assert summary.samples == 2 and summary.errors == len(BAD_ROWS)
    m = load_manifest(tmp_path / "out")
    reasons = {e.sample_id: e.reason for e in m.errors}
    for row, word in BAD_ROWS:
        assert word in reasons[row["id"]].lower(), (row["id"], reasons[row["id"]])
    assert hsx.open(tmp_path / "out").sample_ids == ["chat-a", "text-d"]
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "out")])
    assert result.exit_code == 0 and f"{len(BAD_ROWS)} error record" in result.output


def test_missing_column_and_unreadable_dataset_fail_fast(models, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": "x", "body": "no usable column"}])
    with pytest.raises(HsxError, match="body"):
        extract(config(models, data, tmp_path / "out"), progress=False)
    with pytest.raises(HsxError, match="no such file"):
        extract(config(models, str(tmp_path / "missing.jsonl"), tmp_path / "out2"), progress=False)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(HsxError, match=r"empty.jsonl: no rows \(the file is empty\)"):
        extract(config(models, str(tmp_path / "empty.jsonl"), tmp_path / "out3"), progress=False)


def test_different_config_is_refused_unless_overwrite(models, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", GOOD_ROWS[:2])
    extract(config(models, data, tmp_path / "out"), progress=False)
    again = extract(config(models, data, tmp_path / "out"), progress=False)
    assert again.samples == 0 and again.resumed == 2
    with pytest.raises(HsxError, match="different configuration"):
        extract(config(models, data, tmp_path / "out", layers="final"), progress=False)
    replaced = extract(config(models, data, tmp_path / "out", layers="final"), overwrite=True, progress=False)
    assert replaced.samples == 2 and hsx.open(tmp_path / "out").columns == ["final"]


def _cli_args(models, data, out) -> list[str]:
    return ["extract", "--model", models["target"], "--draft-model", models["draft"], "--dataset", data,
            "--id-field", "id", "--output", str(out), "--layers", "final,b3", "--dtype", "bfloat16",
            "--max-new-tokens", "24", "--batch-size", "2", "--max-shard-samples", "2", "--quiet"]


def test_sigkill_then_resume_gives_each_sample_once(models, tmp_path):
    rows = [{"id": f"t{i}", "text": f"Sample number {i} says: " + "la " * (i % 5)} for i in range(14)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    runner = CliRunner()
    full = runner.invoke(app, _cli_args(models, data, tmp_path / "full"))
    assert full.exit_code == 0, full.output

    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = held_run.start(held_run.AFTER_SHARDS, _cli_args(models, data, out), env, arg=2)  # 2 shards committed
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    partial = load_manifest(out)
    assert not partial.complete and 0 < partial.num_samples < len(rows)

    resumed = runner.invoke(app, _cli_args(models, data, out))
    assert resumed.exit_code == 0, resumed.output
    a, b = hsx.open(tmp_path / "full"), hsx.open(out)
    assert sorted(b.sample_ids) == sorted(r["id"] for r in rows)
    assert len(set(b.sample_ids)) == len(b)
    for sid in a.sample_ids:
        x, y = a.select([sid])[0], b.select([sid])[0]
        assert torch.equal(x.input_ids, y.input_ids)
        for name in a.columns:
            assert torch.equal(x.hidden(name).view(torch.int16), y.hidden(name).view(torch.int16)), (sid, name)
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


def test_cli_extract_inspect_verify(models, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", GOOD_ROWS)
    runner = CliRunner()
    loud = [a for a in _cli_args(models, data, tmp_path / "out") if a != "--quiet"]  # --quiet prints no summary
    result = runner.invoke(app, loud)
    assert result.exit_code == 0, result.output
    assert f"wrote {len(GOOD_ROWS)} samples" in result.output
    info = runner.invoke(app, ["inspect", "--json", str(tmp_path / "out")])
    summary = json.loads(info.output)
    assert summary["samples"] == len(GOOD_ROWS) and summary["accept"]["verify_steps"] > 0
    saved = json.loads((tmp_path / "out" / ".hsx-config.json").read_text())
    assert saved["layers"] == "final,b3" and saved["max_new_tokens"] == 24
    assert runner.invoke(app, ["verify", str(tmp_path / "out")]).exit_code == 0


def test_config_file_rejects_unknown_keys(tmp_path):
    bad = tmp_path / "run.toml"
    bad.write_text('model = "m"\nmodle = "typo"\n')
    result = CliRunner().invoke(app, ["extract", "--config", str(bad)])
    assert result.exit_code != 0
    with pytest.raises(HsxError, match="modle"):
        ExtractConfig.from_file(bad)


def test_sglang_engine_options_become_engine_args_and_hf_refuses_them(tmp_path):
    from hsx.cli import _engine_args
    from hsx.engine.registry import check_engine

    args = _engine_args(2, None, 0.8, "fa3", ["max_running_requests=64", "enable_torch_compile=true", "quantization=fp8"])
    assert args == {"tp_size": 2, "mem_fraction_static": 0.8, "attention_backend": "fa3",
                    "max_running_requests": 64, "enable_torch_compile": True, "quantization": "fp8"}
    with pytest.raises(HsxError, match="hf engine takes none"):
        check_engine(ExtractConfig(model="m", dataset="d", output=str(tmp_path), engine_args={"tp_size": 2}).validate())
    bad = CliRunner().invoke(app, ["extract", "--model", "m", "--dataset", "d", "-o", str(tmp_path / "o"),
                                   "--engine", "sglang", "--engine-arg", "no-equals-sign"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
