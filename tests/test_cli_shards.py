"""``hsx inspect`` and ``hsx verify`` through CliRunner: counts, faults, exit codes, help."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hsx.cli import app, main
from hsx.shards import ShardWriter, load_manifest
from shard_fixtures import finite_records, make_metadata, make_record, write_sink

runner = CliRunner()


@pytest.fixture
def known(tmp_path) -> Path:
    """Three samples in two shards, one error record; every count below is worked out by hand."""
    meta = make_metadata([4, 6], "bfloat16", "generate")
    gen = torch.Generator().manual_seed(0)

    def rec(i, n, prompt, accept):
        hidden = {"l0": torch.randn(n - 1, 4, generator=gen).bfloat16(), "l1": torch.randn(n - 1, 6, generator=gen).bfloat16()}
        acc = None if accept is None else torch.tensor(accept, dtype=torch.int16)
        return make_record(i, n, meta, hidden, acc, prompt_len=prompt)

    records = [
        rec(0, 5, 2, [1, 2]),  # 3 completion tokens: the first from prefill, 2 decoded in 2 steps
        rec(1, 4, 1, [2]),  # 3 completion tokens, 2 decoded in one step
        rec(2, 3, 3, None),  # prompt only
    ]
    d = tmp_path / "known"
    write_sink(d, meta, records, errors=[("broken", 9, "empty text")], max_shard_samples=2)
    return d


def test_inspect_json_counts(known):
    result = runner.invoke(app, ["inspect", str(known), "--json"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.output)
    assert s["samples"] == 3 and s["shards"] == 2 and s["errors"] == 1 and s["complete"] is True
    assert s["tokens"] == 12 and s["prompt_tokens"] == 6 and s["completion_tokens"] == 6
    assert s["rows_per_column"] == 4 + 3 + 2
    size = sum(p.stat().st_size for p in known.glob("shard-*.parquet"))
    assert s["bytes"] == size == sum(e.bytes for e in load_manifest(known).shards)
    assert s["bytes_per_token"] == pytest.approx(size / 12)
    assert s["accept"] == {"verify_steps": 3, "mean_accept_len": pytest.approx(5 / 3), "histogram": {"1": 1, "2": 2}}
    assert s["finish_reasons"] == {"stop": 2, "length": 1}
    assert s["dtype"] == "bfloat16" and s["mode"] == "generate"
    assert [g["name"] for g in s["layers"]] == ["l0", "l1"] and [g["width"] for g in s["layers"]] == [4, 6]


def test_inspect_text_counts(known):
    result = runner.invoke(app, ["inspect", str(known)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "samples       3 in 2 shard(s), 1 error record(s)" in out
    assert "tokens        12 (6 prompt + 6 completion)" in out
    assert "rows/column   9   mode generate" in out
    assert "mean 1.67 tokens/step over 3 verify steps  [1:1, 2:2]" in out
    assert "dtype         bfloat16" in out
    assert "l0" in out and "l1" in out and "incomplete" not in out


def test_inspect_of_one_file(known):
    result = runner.invoke(app, ["inspect", str(known / "shard-00001.parquet"), "--json"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.output)
    assert s["samples"] == 1 and s["tokens"] == 3 and s["rows_per_column"] == 2 and "accept" not in s


def test_verify_clean_output(known):
    result = runner.invoke(app, ["verify", str(known)])
    assert result.exit_code == 0, result.output
    assert "ok     shard-00000.parquet: 2 samples, 7 rows" in result.output
    assert "ok     shard-00001.parquet: 1 samples, 2 rows" in result.output
    assert "1 sample(s) recorded as input errors" in result.output
    assert result.output.rstrip().endswith("verify: OK")


def write_one(path: Path, meta: dict, records) -> None:
    with ShardWriter(path, meta) as w:
        w.write(records)


@pytest.mark.parametrize("mode,extra", [("generate", 1), ("generate", -1), ("prefill", -1), ("prefill", 1)])
def test_verify_reports_wrong_alignment_row_counts(tmp_path, mode, extra):
    meta = make_metadata([3], "float16", mode)
    records = finite_records(meta, [4, 5, 3])
    bad = records[1]
    n = bad.input_ids.numel()
    rows = (n - 1 if mode == "generate" else n) + extra
    bad.hidden = {"l0": torch.zeros(rows, 3, dtype=torch.float16)}
    f = tmp_path / "rows.parquet"
    write_one(f, meta, records)
    result = runner.invoke(app, ["verify", str(f)])
    assert result.exit_code == 1, result.output
    assert f"sample 's001': {rows} rows of 'l0' for {n} tokens" in result.output
    assert "rows.parquet" in result.output and "verify: FAILED" in result.output
    assert "'s000'" not in result.output and "'s002'" not in result.output


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_verify_reports_nan_and_inf_rows_naming_the_sample(tmp_path, value):
    meta = make_metadata([4, 2], "bfloat16", "generate")
    records = finite_records(meta, [3, 4, 5, 6, 3])
    records[3].hidden["l1"][2, 1] = value  # sample s003, position 2, in the second row group
    f = tmp_path / "nan.parquet"
    with ShardWriter(f, meta) as w:
        w.write(records[:2])
        w.write(records[2:])
    result = runner.invoke(app, ["verify", str(f)])
    assert result.exit_code == 1, result.output
    fault = next(ln for ln in result.output.splitlines() if "NaN/Inf" in ln)
    assert "'l1'" in fault and "1 rows" in fault and "position 2" in fault
    assert "s003" in fault, fault
    assert "'l0'" not in result.output


def test_verify_json_reports_faults(tmp_path):
    meta = make_metadata([3], "bfloat16", "prefill")
    records = finite_records(meta, [2, 3])
    records[0].hidden = {"l0": torch.zeros(1, 3, dtype=torch.bfloat16)}
    d = tmp_path / "out"
    write_sink(d, meta, records)
    result = runner.invoke(app, ["verify", str(d), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["ok"] is False
    assert any("sample 's000': 1 rows of 'l0' for 2 tokens" in f for f in report["shards"][0]["faults"])


def test_verify_of_a_directory_without_manifest_fails(tmp_path):
    result = runner.invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and "no manifest" in result.output


def test_hsx_error_exits_2_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hsx", "inspect", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "manifest" in err


@pytest.mark.parametrize("args", [["--help"], ["inspect", "--help"], ["verify", "--help"]])
def test_help(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
    if args[0] == "--help":
        assert "inspect" in result.output and "verify" in result.output
    else:
        assert "--json" in result.output and "Print machine-readable JSON." in result.output
