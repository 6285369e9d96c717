"""What a new user meets first: bad input files, refusals, inspect, --help, the options table in docs/OPTIONS.md,
empty chat turns, and the notebook's prefill-mode panel; each through the CLI or the Python API."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

import hsx
import hsx.analysis as A
from hsx.cli import app, main
from hsx.data.render import Renderer
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError, SampleError
from hsx.shards.manifest import load_manifest
from shard_fixtures import finite_records, make_metadata, write_sink

torch.set_num_threads(1)
OPTIONS = Path(__file__).resolve().parents[1] / "docs" / "OPTIONS.md"
ROWS = [{"id": "a", "text": "The kettle clicked off."}, {"id": "b", "text": "Rain on the window."},
        {"id": "c", "messages": [{"role": "user", "content": "Name a colour."}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("first_hour_model")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=len(tok), seed=2,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


def extract_args(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["extract", "--model", model, "--dataset", str(data), "--output", str(out), "--id-field", "id",
            "--max-new-tokens", "3", "--quiet", *extra]


def run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    """The installed ``hsx`` entry point (where HsxError becomes ``error: ...`` and exit 2)."""
    monkeypatch.setattr(sys, "argv", ["hsx", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- bad input files

BAD_FILES = {
    "latin-1": (lambda p: p.write_bytes(b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "caf\xe9"}\n'),
                r"data.jsonl:2, column 25: byte 0xe9 is not valid UTF-8"),
    "malformed line": (lambda p: p.write_text('{"id": "a", "text": "fine"}\n\n{"id": "b", "text": oops}\n'),
                       r"data.jsonl:3, column 21: not valid JSON \(Expecting value\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_input_file_names_file_and_line_and_the_fixed_rerun_just_runs(model_dir, tmp_path, monkeypatch, capsys, case):
    write_bad, message = BAD_FILES[case]
    data, out = tmp_path / "data.jsonl", tmp_path / "out"
    write_bad(data)
    code, err = run_main(monkeypatch, capsys, extract_args(model_dir, data, out))
    last = err.strip().splitlines()[-1]  # above it only the datasets library's progress bar
    assert code == 2 and last.startswith("error: ") and re.search(message, last), err
    assert "Traceback" not in err and "row 1" not in err
    assert not out.exists() or not any(out.iterdir())  # nothing written that a rerun would trip over

    write_rows(data, ROWS)  # the user fixes the file and runs the very same command
    result = CliRunner().invoke(app, extract_args(model_dir, data, out))
    assert result.exit_code == 0, result.output
    assert hsx.open(out).sample_ids == ["a", "b", "c"]


def test_an_output_that_committed_nothing_does_not_block_a_different_run(model_dir, tmp_path):
    data, out = write_rows(tmp_path / "data.jsonl", ROWS), tmp_path / "out"
    runner = CliRunner()
    first = runner.invoke(app, extract_args(model_dir, data, out, "--limit", "0"))
    assert first.exit_code == 0, first.output
    assert load_manifest(out).shards == []
    second = runner.invoke(app, extract_args(model_dir, data, out, "--mode", "prefill"))
    assert second.exit_code == 0, second.output
    assert hsx.open(out).metadata["mode"] == "prefill" and len(hsx.open(out)) == 3


def test_a_config_refusal_names_the_options_that_differ(model_dir, tmp_path):
    data, out = write_rows(tmp_path / "data.jsonl", ROWS), tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(app, extract_args(model_dir, data, out)).exit_code == 0
    again = runner.invoke(app, extract_args(model_dir, data, out, "--max-new-tokens", "5", "--layers", "final,1",
                                            "--batch-size", "2"))
    assert isinstance(again.exception, HsxError)
    msg = str(again.exception)
    assert "max_new_tokens: 3 -> 5" in msg and "layers: 'final' -> 'final,1'" in msg, msg
    assert "batch_size" not in msg and "dataset" not in msg  # layout-only and unchanged fields are not listed
    assert "--overwrite" in msg


# --------------------------------------------------------------------------- inspect

def test_inspect_of_a_missing_path_is_a_clean_error(tmp_path, monkeypatch, capsys):
    for args in (["inspect", str(tmp_path / "no" / "such")], ["inspect", str(tmp_path / "x.parquet")]):
        code, err = run_main(monkeypatch, capsys, args)
        assert code == 2 and err.startswith("error: ") and "no such file or directory" in err, err
        assert "Traceback" not in err
    (tmp_path / "junk.parquet").write_text("not parquet")
    code, err = run_main(monkeypatch, capsys, ["inspect", str(tmp_path / "junk.parquet")])
    assert code == 2 and "junk.parquet: not a readable Parquet file" in err, err


def test_inspect_lists_error_records_and_all_of_them_with_errors(tmp_path):
    meta = make_metadata([4])
    errors = [(f"train:{i}", i, f"column 'text': text is empty or whitespace (case {i})") for i in range(12)]
    write_sink(tmp_path, meta, finite_records(meta, [3, 4]), errors=errors)
    runner = CliRunner()
    short = runner.invoke(app, ["inspect", str(tmp_path)])
    assert short.exit_code == 0, short.output
    assert "12 sample(s) not extracted" in short.output
    listed = re.findall(r"^\s+(train:\d+)  \(source row (\d+)\): (.*)$", short.output, re.M)
    assert [x[0] for x in listed] == [f"train:{i}" for i in range(10)]
    assert listed[3] == ("train:3", "3", "column 'text': text is empty or whitespace (case 3)")
    assert "... and 2 more (hsx inspect --errors lists them all)" in short.output
    full = runner.invoke(app, ["inspect", str(tmp_path), "--errors"])
    assert len(re.findall(r"^\s+train:\d+  \(source row", full.output, re.M)) == 12 and "more" not in full.output
    as_json = json.loads(runner.invoke(app, ["inspect", str(tmp_path), "--json"]).output)
    assert as_json["errors"] == 12 and as_json["error_records"][11] == {"sample_id": "train:11", "source_index": 11,
                                                                        "reason": errors[11][2]}


# --------------------------------------------------------------------------- --help and docs/OPTIONS.md

def _extract_command():
    return typer.main.get_command(app).commands["extract"]


def help_entries(text: str) -> dict[str, str]:
    """``--option`` -> its whole help entry (the option line and the lines wrapped under it)."""
    entries, current = {}, None
    for line in text.splitlines():
        if (m := re.match(r"^  (?:-[a-z], )?(--[a-z0-9-]+)", line)):
            current = m.group(1)
            entries[current] = line.strip()
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_extract_help_marks_required_options_and_shows_defaults(tmp_path):
    runner = CliRunner()
    text = runner.invoke(app, ["extract", "--help"], env={"NO_COLOR": "1"}).output
    lines = help_entries(text)
    for name in ("--model", "--dataset", "--output"):
        assert "[required]" in lines[name], lines[name]
    for name, default in (("--mode", "generate"), ("--layers", "final"), ("--engine", "hf"), ("--keep", "all"),
                          ("--batch-size", "8"), ("--dtype", "bfloat16")):
        assert f"[default: {default}]" in lines[name], lines[name]
    missing = runner.invoke(app, ["extract", "--dataset", "d", "--output", str(tmp_path / "o")])
    assert missing.exit_code == 2 and "Missing option '--model'" in missing.output


def test_required_options_may_come_from_the_config_file(model_dir, tmp_path):
    data = write_rows(tmp_path / "data.jsonl", ROWS)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'model = "{model_dir}"\ndataset = "{data}"\noutput = "{tmp_path / "out"}"\n'
                   'id_field = "id"\nmax_new_tokens = 2\nmode = "prefill"\n')
    result = CliRunner().invoke(app, ["extract", "--config", str(cfg), "--quiet"])
    assert result.exit_code == 0, result.output
    ds = hsx.open(tmp_path / "out")
    assert ds.metadata["mode"] == "prefill" and len(ds) == 3  # the file's mode, not the shown default


def test_options_table_names_every_extract_option():
    text = OPTIONS.read_text()
    table = text[text.index("| option |"):text.index("## How a run goes")]
    documented = set(re.findall(r"`(--[a-z0-9-]+)", table))
    options = {o for p in _extract_command().params for o in p.opts if o.startswith("--")} - {"--help"}
    assert options - documented == set(), f"docs/OPTIONS.md's table lacks {sorted(options - documented)}"
    assert documented - options == set(), f"docs/OPTIONS.md documents options extract lacks: {sorted(documented - options)}"


# --------------------------------------------------------------------------- chats and the notebook

@pytest.mark.parametrize("content", ["", "   ", "\n\t"])
def test_a_chat_whose_user_turn_is_empty_is_refused(content):
    tok = build_demo_tokenizer()
    for mode in ("generate", "prefill"):
        r = Renderer(tok, mode, id_field="id")
        row = {"id": "x", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content},
                                       {"role": "assistant", "content": "Hello."}]}
        with pytest.raises(SampleError, match=r"'messages' turn 1: the user turn is empty or whitespace"):
            r.render(row, 0)
        share = {"id": "y", "conversations": [{"from": "human", "value": content}]}
        with pytest.raises(SampleError, match=r"'conversations' turn 0: the user turn is empty"):
            Renderer(tok, mode, id_field="id").render(share, 0)


def test_empty_user_turns_become_error_records_in_a_run(model_dir, tmp_path):
    rows = ROWS + [{"id": "empty", "messages": [{"role": "user", "content": "  "}]}]
    data, out = write_rows(tmp_path / "data.jsonl", rows), tmp_path / "out"
    result = CliRunner().invoke(app, extract_args(model_dir, data, out))
    assert result.exit_code == 0, result.output
    assert hsx.open(out).sample_ids == ["a", "b", "c"]
    assert [(e.sample_id, e.source_index) for e in hsx.open(out).errors] == [("empty", 3)]
    assert "the user turn is empty" in hsx.open(out).errors[0].reason


@pytest.mark.parametrize("mode,kinds", [("generate", {"prompt", "completion"}), ("prefill", {"assistant", "context"})])
def test_the_pca_split_panel_has_both_kinds_in_either_mode(tmp_path, mode, kinds):
    meta = make_metadata([4], mode=mode)
    records = finite_records(meta, [5, 6, 4], seed=7)
    write_sink(tmp_path, meta, records)
    ds = hsx.open(tmp_path)
    table = A.token_table(ds)
    kind, title = A.token_split(ds, table)
    assert set(kind.unique()) == kinds and len(kind) == len(table)
    if mode == "prefill":
        assert (kind == "assistant").to_numpy().tolist() == table["loss_mask"].astype(bool).tolist()
        assert "loss_mask" in title
    else:
        assert ((kind == "prompt") == table["is_prompt"]).all()


def test_a_changed_dataset_refusal_names_the_metadata_fields(model_dir, tmp_path):
    data, out = write_rows(tmp_path / "data.jsonl", ROWS), tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(app, extract_args(model_dir, data, out)).exit_code == 0
    write_rows(data, ROWS + [{"id": "d", "text": "One more row."}])
    again = runner.invoke(app, extract_args(model_dir, data, out))
    assert isinstance(again.exception, HsxError)
    msg = str(again.exception)
    assert "dataset.num_rows: 3 -> 4" in msg and "dataset.fingerprint: '" in msg, msg
    assert hsx.open(out).sample_ids == ["a", "b", "c"]  # the committed run is untouched


def test_differences_lists_leaf_fields_and_shortens_long_values():
    from hsx.run.pipeline import differences

    old = {"a": 1, "b": {"c": "x" * 100, "d": 2}, "same": [1, 2]}
    new = {"a": 2, "b": {"c": "y" * 100, "d": 2}, "same": [1, 2], "e": None}
    got = differences(old, new)
    assert got[0] == "a: 1 -> 2" and got[1].startswith("b.c: 'xxx") and got[1].count("...") == 2
    assert len(got) == 2  # e: None on one side and absent on the other is no difference
