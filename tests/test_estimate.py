"""``hsx extract --dry-run``: tokens, rows and bytes from the configuration alone, against the run itself."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.run.estimate import BASE_BYTES_PER_TOKEN, CODEC_RATIO, estimate
from hsx.shards.manifest import load_manifest

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("estimate")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=4, hidden_size=64, vocab_size=len(tok), seed=5,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": "Tell me about rivers " * (1 + i % 3)},
                                         {"role": "assistant", "content": "Rivers run to the sea. " * (1 + i % 2)}]}
            for i in range(7)] + [{"id": "bad", "messages": "not a list"}]
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), "data": str(data)}


@pytest.mark.parametrize("keep", ["all", "loss", "last"])
def test_dry_run_predicts_the_tokens_and_rows_of_the_run(setup, tmp_path, keep):
    out = tmp_path / "out"
    args = ["extract", "--model", setup["model"], "--dataset", setup["data"], "--id-field", "id", "--output", str(out),
            "--mode", "prefill", "--layers", "final,eagle3,0", "--keep", keep, "--compression", "none", "--quiet"]
    dry = CliRunner().invoke(app, args + ["--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert not out.exists()  # nothing written
    cfg = ExtractConfig(model=setup["model"], dataset=setup["data"], output=str(out), mode="prefill",
                        layers="final,eagle3,0", keep=keep, compression="none", id_field="id")
    est = estimate(cfg)

    assert CliRunner().invoke(app, args).exit_code == 0
    m = load_manifest(out)
    assert (est.samples, est.skipped) == (m.num_samples, len(m.errors)) == (7, 1)
    assert est.tokens == sum(s.tokens for s in m.shards)
    assert est.rows == sum(s.rows for s in m.shards)
    row_bytes = sum(g["row_bytes"] for g in m.metadata["layers"])
    assert est.raw_bytes == est.rows * row_bytes and est.columns == {"final": 64, "eagle3": 192, "b0": 64}
    assert f"tokens   {est.tokens:,}" in dry.output and f"x{CODEC_RATIO['none']:.2f} of raw" in dry.output


def test_dry_run_in_generate_mode_is_an_upper_bound(setup, tmp_path):
    cfg = ExtractConfig(model=setup["model"], dataset=setup["data"], output=str(tmp_path / "out"), mode="generate",
                        layers="final", max_new_tokens=5, id_field="id")
    est = estimate(cfg)
    assert est.upper_bound and est.samples == 7
    assert CliRunner().invoke(app, ["extract", "--model", setup["model"], "--dataset", setup["data"], "--id-field", "id",
                                    "--output", str(tmp_path / "out"), "--layers", "final", "--max-new-tokens", "5",
                                    "--quiet"]).exit_code == 0
    m = load_manifest(tmp_path / "out")
    assert sum(s.tokens for s in m.shards) <= est.tokens and sum(s.rows for s in m.shards) <= est.rows
    assert est.bytes == int(est.raw_bytes * CODEC_RATIO["planes-zstd"] + BASE_BYTES_PER_TOKEN * est.tokens)
