"""Mistakes refused before any weight loads (hsx.run.preflight), Ctrl-C and resume, quiet output, --help
at 80 columns; through the CLI (CliRunner) and, where the whole process matters, a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import typer
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError
from hsx.run.preflight import check_extract, looks_local, model_config
from hsx.shards.manifest import load_manifest

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"id": f"r{i}", "text": f"Row number {i} talks about the kettle and the rain."} for i in range(6)]
NUM_LAYERS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("preflight_model")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=32, vocab_size=len(tok), seed=3,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


@pytest.fixture
def no_engine(monkeypatch):
    """Any model load fails the test: what is checked here must be refused before it."""
    import hsx.engine.registry

    def refuse(cfg):
        raise AssertionError("the engine was built before the mistake was refused")

    monkeypatch.setattr(hsx.engine.registry, "build_engine", refuse)


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def args(model: str, data, out, *extra: str) -> list[str]:
    return ["extract", "--model", model, "--dataset", str(data), "--output", str(out), "--id-field", "id",
            "--max-new-tokens", "3", "--quiet", *extra]


def refused(result) -> str:
    assert isinstance(result.exception, HsxError), (result.exception, result.output)
    return str(result.exception)


# --------------------------------------------------------------------------- how a model is named

@pytest.mark.parametrize("name,local", [
    ("/abs/path", True), ("./rel", True), ("~/models/x", True), ("a/b/c", True), ("has space", True),
    ("gpt2", False), ("org/name", False), ("org/name-v1.5_x", False),
])
def test_a_path_is_local_and_a_hub_id_is_not(tmp_path, monkeypatch, name, local):
    monkeypatch.chdir(tmp_path)
    assert looks_local(name) is local


def test_a_relative_path_whose_directory_exists_is_local_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "target").mkdir(parents=True)
    assert looks_local("models/targt")
    with pytest.raises(HsxError, match=r"--model 'models/targt': no such directory \(did you mean models/target\?\)"):
        model_config("models/targt", "--model")


def _dir_with(tmp_path: Path, model_dir: str, keep: set[str]) -> Path:
    d = tmp_path / "partial"
    d.mkdir()
    for p in Path(model_dir).iterdir():
        if p.name in keep:
            (d / p.name).write_bytes(p.read_bytes())
    return d


@pytest.mark.parametrize("keep,missing,present", [
    (set(), ["no config.json", "no weights", "no tokenizer files", "it is empty"], []),
    ({"config.json"}, ["no weights", "no tokenizer files"], ["no config.json"]),
    ({"config.json", "model.safetensors"}, ["no tokenizer files"], ["no config.json", "no weights"]),
    ({"model.safetensors", "tokenizer.json", "tokenizer_config.json"}, ["no config.json"], ["no weights", "no tokenizer"]),
])
def test_a_directory_that_is_not_a_model_says_what_is_missing(model_dir, tmp_path, no_engine, keep, missing, present):
    d = _dir_with(tmp_path, model_dir, keep)
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    msg = refused(CliRunner().invoke(app, args(str(d), data, tmp_path / "out")))
    assert msg.startswith(f"--model {str(d)!r} is not a model directory"), msg
    for text in missing:
        assert text in msg, msg
    for text in present:
        assert text not in msg, msg


def test_a_config_without_model_type_is_refused(model_dir, tmp_path, no_engine):
    d = _dir_with(tmp_path, model_dir, {p.name for p in Path(model_dir).iterdir()})
    config = json.loads((d / "config.json").read_text())
    del config["model_type"]
    (d / "config.json").write_text(json.dumps(config))
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    assert "its config.json has no model_type" in refused(CliRunner().invoke(app, args(str(d), data, tmp_path / "out")))


def test_a_draft_needs_no_tokenizer_files_but_a_target_does(model_dir, tmp_path):
    d = _dir_with(tmp_path, model_dir, {"config.json", "model.safetensors"})
    assert model_config(str(d), "--draft-model", tokenizer=False).num_hidden_layers == NUM_LAYERS
    with pytest.raises(HsxError, match="no tokenizer files"):
        model_config(str(d), "--model")


@pytest.mark.parametrize("option", ["--model", "--draft-model"])
def test_a_mistyped_model_path_fails_at_once_naming_the_option(model_dir, tmp_path, no_engine, option):
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    wrong = model_dir + "x"
    argv = args(wrong, data, tmp_path / "out") if option == "--model" else \
        args(model_dir, data, tmp_path / "out", "--draft-model", wrong)
    msg = refused(CliRunner().invoke(app, argv))
    assert msg.startswith(f"{option} {wrong!r}: no such directory (did you mean {model_dir}?)"), msg
    (tmp_path / "config.json").write_text("{}")
    msg = refused(CliRunner().invoke(app, args(str(tmp_path / "config.json"), data, tmp_path / "out")))
    assert "is a file; expected a model directory (pass the directory holding it)" in msg


def test_a_hub_id_not_in_the_cache_fails_at_once_when_offline(model_dir, tmp_path, monkeypatch, no_engine):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    msg = refused(CliRunner().invoke(app, args("someorg/somemodel", data, tmp_path / "out")))
    assert msg.startswith("--model 'someorg/somemodel': no such local directory, and as a hub id it is not in the "
                          "local Hugging Face cache while HF_HUB_OFFLINE is set"), msg


def test_a_cached_hub_id_is_read_from_the_cache(model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read at import: the module's value
    monkeypatch.chdir(tmp_path)
    repo = tmp_path / "hub" / "models--someorg--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        (repo / "snapshots" / "abc123" / f.name).write_bytes(f.read_bytes())
    assert model_config("someorg/tiny", "--model").num_hidden_layers == NUM_LAYERS
    cfg = ExtractConfig(model="someorg/tiny", dataset=str(write_rows(tmp_path / "d.jsonl", ROWS)),
                        output=str(tmp_path / "out"), layers="final,7")
    with pytest.raises(HsxError, match=rf"boundary 7 is outside 0..{NUM_LAYERS}"):
        check_extract(cfg)  # the cached config.json is checked like a local one


def test_an_unreachable_hub_puts_the_process_offline(monkeypatch):
    import socket

    import huggingface_hub.constants as constants

    from hsx.run.preflight import hub_offline

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(address, timeout):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    hub_offline.cache_clear()
    try:
        assert hub_offline() == "huggingface.co:443 cannot be reached (Network is unreachable)"
        assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
    finally:
        hub_offline.cache_clear()


def test_verify_recompute_checks_its_model_path_before_loading(tmp_path):
    from shard_fixtures import finite_records, make_metadata, write_sink

    meta = make_metadata([4])
    write_sink(tmp_path / "shards", meta, finite_records(meta, [3, 4]))
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "shards"), "--recompute", "--model", str(tmp_path / "empty")])
    assert "is not a model directory: no config.json" in refused(result)
    meta = make_metadata([4])
    meta["model"]["path"] = str(tmp_path / "moved")
    write_sink(tmp_path / "moved-shards", meta, finite_records(meta, [3]))
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "moved-shards"), "--recompute"])
    assert refused(result).startswith(f"the shards' model (another copy: --model) {str(tmp_path / 'moved')!r}: "
                                      "no such directory")


# --------------------------------------------------------------------------- refused before the model loads

def _parquet(tmp_path: Path) -> Path:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [r["id"] for r in ROWS], "body": [r["text"] for r in ROWS]}), path)
    return path


def _saved(tmp_path: Path) -> Path:
    import datasets

    path = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(path))
    return path


def _saved_single(tmp_path: Path) -> Path:
    import datasets

    path = tmp_path / "saved-one"
    datasets.Dataset.from_list([{"id": r["id"], "body": r["text"]} for r in ROWS]).save_to_disk(str(path))
    return path


MISTAKES = {
    "missing dataset": (lambda t: t / "nope.jsonl", [], r"dataset '.*nope.jsonl': no such file or directory"),
    "layer out of range": (None, ["--layers", "final,999"], rf"boundary 999 is outside 0..{NUM_LAYERS} for a {NUM_LAYERS}-block model"),
    "keep completion in prefill": (None, ["--keep", "completion", "--mode", "prefill"], r"--keep completion needs generate mode"),
    "missing text field": (None, ["--text-field", "body"], r"--text-field 'body' is not a column of the dataset; its columns are \['id', 'text'\]"),
    "split of a file": (None, ["--split", "test"], r"has no split 'test'; available splits: \['train'\]"),
    "parquet without a text column": (_parquet, [], r"no column to render.*its columns are \['id', 'body'\]"),
    "saved dataset split": (_saved, ["--split", "validation"], r"has no split 'validation'; available splits: \['train'\]"),
    "saved dataset without a text column": (_saved_single, [], r"no column to render.*its columns are \['id', 'body'\]"),
    "max length beyond the model": (None, ["--max-length", "5000"], r"--max-length 5000 is longer than the model's context \(max_position_embeddings 1024"),
    "spec options without a draft": (None, ["--spec-topk", "2"], r"--spec-\* options need --draft-model"),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_a_mistake_is_refused_before_the_model_loads(model_dir, tmp_path, no_engine, case):
    make_data, extra, message = MISTAKES[case]
    data = make_data(tmp_path) if make_data else write_rows(tmp_path / "d.jsonl", ROWS)
    msg = refused(CliRunner().invoke(app, args(model_dir, data, tmp_path / "out", *extra)))
    assert re.search(message, msg), msg
    assert not (tmp_path / "out").exists()


def test_an_output_of_another_configuration_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    data, out = write_rows(tmp_path / "d.jsonl", ROWS), tmp_path / "out"
    assert CliRunner().invoke(app, args(model_dir, data, out)).exit_code == 0
    import hsx.engine.registry

    monkeypatch.setattr(hsx.engine.registry, "build_engine", lambda cfg: pytest.fail("engine built"))
    msg = refused(CliRunner().invoke(app, args(model_dir, data, out, "--max-new-tokens", "5")))
    assert "holds a run with a different configuration (max_new_tokens: 3 -> 5)" in msg, msg


def test_columns_are_the_union_of_a_jsonl_files_rows(model_dir, tmp_path):
    rows = ROWS[:2] + [{"id": "c", "body": "only the third row has this column"}]
    data = write_rows(tmp_path / "d.jsonl", rows)
    cfg = ExtractConfig(model=model_dir, dataset=str(data), output=str(tmp_path / "out"), text_field="body")
    check_extract(cfg)  # 'body' is not in the first row, but the loader's columns are the union
    with pytest.raises(HsxError, match=r"--text-field 'title' is not a column.*\['id', 'text', 'body'\]"):
        check_extract(ExtractConfig(**{**cfg.to_dict(), "text_field": "title"}))


def test_a_directory_not_written_by_save_to_disk_is_left_to_the_loader(tmp_path):
    from hsx.run.preflight import dataset_columns

    d = tmp_path / "files"
    d.mkdir()
    write_rows(d / "train.jsonl", ROWS)
    (d / "dataset_info.json").write_text(json.dumps({"features": {"other": {"dtype": "string"}}}))
    assert dataset_columns(d, str(d), "train") is None
    assert dataset_columns(_saved(tmp_path), "saved", "train") == ["id", "text"]


def test_the_python_api_runs_the_same_checks(model_dir, tmp_path, no_engine):
    from hsx.run.pipeline import extract

    cfg = ExtractConfig(model=str(tmp_path / "nothing"), dataset="d.jsonl", output=str(tmp_path / "out"))
    with pytest.raises(HsxError, match="--model .*nothing': no such directory"):
        extract(cfg)


def test_a_mistake_is_refused_without_importing_torch(model_dir, tmp_path):
    """The whole process: the refusal comes before torch (seconds of import) is loaded."""
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    code = ("import sys\nfrom hsx.cli import main\ntry:\n    main()\nexcept SystemExit as e:\n"
            "    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n    raise\n")
    for extra in (["--layers", "999"], ["--keep", "completion", "--mode", "prefill"]):
        p = subprocess.run([sys.executable, "-c", code, *args(model_dir, data, tmp_path / "out", *extra)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith("error: ") and "torch imported: False" in p.stderr, p.stderr


# --------------------------------------------------------------------------- Ctrl-C, resume, quiet output

def test_ctrl_c_says_what_is_committed_and_the_same_command_resumes(model_dir, tmp_path):
    rows = [{"id": f"r{i}", "text": f"Sample {i}: the kettle clicked off and the rain went on."} for i in range(400)]
    data, out = write_rows(tmp_path / "d.jsonl", rows), tmp_path / "out"
    argv = args(model_dir, data, out, "--max-new-tokens", "16", "--batch-size", "2", "--window", "2",
                "--max-shard-samples", "4")
    argv.remove("--quiet")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hsx.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    manifest = out / ".hsx-manifest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and len(load_manifest(out).shards) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    committed = hsx.open(out).sample_ids
    assert 8 <= len(committed) < len(rows)
    assert stderr.strip().splitlines()[-1] == (f"interrupted: {len(committed):,} samples committed to {out}; "
                                               "re-run the same command to resume"), stderr
    assert "Traceback" not in stderr and stdout == ""

    again = subprocess.run([sys.executable, "-m", "hsx.cli", *argv, "--limit", "40"], capture_output=True, text=True,
                           env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resumed: {min(len(committed), 40):,} samples were already done" in again.stdout, again.stdout
    for noise in ("Loading weights", "Generating train split", "Retrying"):
        assert noise not in again.stderr, again.stderr
    assert again.stdout.count("wrote ") == 1
    ids = hsx.open(out).sample_ids
    assert sorted(ids) == sorted(set(ids)) and set(ids) >= {f"r{i}" for i in range(40)}


def test_quiet_prints_nothing_and_the_default_prints_one_summary(model_dir, tmp_path, monkeypatch):
    from hsx.run.report import LIBRARY_QUIET

    for key in LIBRARY_QUIET:
        monkeypatch.delenv(key, raising=False)
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    quiet = CliRunner().invoke(app, args(model_dir, data, tmp_path / "a"))
    assert quiet.exit_code == 0 and quiet.output == "", quiet.output
    assert all(os.environ[k] == v for k, v in LIBRARY_QUIET.items())
    argv = args(model_dir, data, tmp_path / "b")
    argv.remove("--quiet")
    loud = CliRunner().invoke(app, argv)
    assert loud.exit_code == 0 and loud.stdout.startswith(f"wrote {len(ROWS)} samples") and loud.stdout.count("wrote") == 1


def test_verbose_leaves_the_libraries_alone(model_dir, tmp_path, monkeypatch):
    from hsx.run.report import LIBRARY_QUIET

    for key in LIBRARY_QUIET:
        monkeypatch.delenv(key, raising=False)
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    assert CliRunner().invoke(app, [*args(model_dir, data, tmp_path / "a"), "-v"]).exit_code == 0
    assert not any(k in os.environ for k in LIBRARY_QUIET)


# --------------------------------------------------------------------------- --help at 80 columns

def _options(command: str) -> list[str]:
    cmd = typer.main.get_command(app).commands[command]
    return [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


@pytest.mark.parametrize("command", ["extract", "verify", "inspect"])
def test_help_at_80_columns_shows_every_option_whole(command):
    text = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}).output
    for option in _options(command):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), f"{option} is not shown whole"
    assert "<bool>" not in text and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    if command == "extract":
        assert "(needs hsx[ray])" in text


def test_help_follows_the_terminal_width_in_a_real_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    widths = {}
    for columns in (80, 160):
        p = subprocess.run([sys.executable, "-m", "hsx.cli", "extract", "--help"], capture_output=True, text=True,
                           env={**env, "COLUMNS": str(columns)}, timeout=60)
        assert p.returncode == 0, p.stderr
        widths[columns] = max(len(line) for line in p.stdout.splitlines())
        assert all(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", p.stdout) for o in _options("extract"))
    assert widths[80] <= 80 < widths[160] <= 160
