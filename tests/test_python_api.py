"""The Python entry points after a bare ``import hsx``: light to import, the documented names reachable."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hsx
from hsx.errors import HsxError

HEAVY = ("torch", "transformers", "datasets", "pyarrow", "numpy")


def test_import_hsx_loads_nothing_heavy():
    code = f"import sys, hsx; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []


def test_documented_names_are_reachable_after_import_hsx():
    from hsx.config import ExtractConfig
    from hsx.run.pipeline import extract
    from hsx.recompute import recompute

    assert hsx.extract is extract and hsx.run.pipeline.extract is extract
    assert hsx.ExtractConfig is ExtractConfig and hsx.config.ExtractConfig is ExtractConfig
    assert hsx.recompute.recompute is recompute
    for name in hsx.SUBMODULES:
        assert getattr(hsx, name).__name__ == f"hsx.{name}"
    with pytest.raises(AttributeError, match="module 'hsx' has no attribute 'extrakt'"):
        hsx.extrakt


def test_extract_from_python_quietly(tmp_path, capfd):
    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer

    tok = build_demo_tokenizer()
    build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "The kettle clicked off."}) + "\n")
    capfd.readouterr()
    cfg = hsx.config.ExtractConfig(model=str(tmp_path / "m"), dataset=str(tmp_path / "d.jsonl"),
                                   output=str(tmp_path / "out"), max_new_tokens=3)
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # a notebook's state: the libraries' bars on
    summary = hsx.run.pipeline.extract(cfg, progress=False)  # the expression the front page gives
    assert summary.samples == 1 and len(hsx.open(tmp_path / "out")) == 1
    err = capfd.readouterr().err
    assert "sample/s" not in err  # no progress bar
    assert "Loading weights" not in err and "Generating train split" not in err  # nor the libraries' bars
    assert hf_logging.is_progress_bar_enabled()  # and their switches are as they were
    feed = hsx.stream(dict(cfg.to_dict(), output=""))
    assert len(list(feed.records())) == 1
    assert "Loading weights" not in capfd.readouterr().err
    loud = hsx.stream(dict(cfg.to_dict(), output=""), verbose=True)
    assert len(list(loud.records())) == 1 and "Loading weights" in capfd.readouterr().err


@pytest.mark.parametrize("key,how", [("quiet", "progress=False"), ("overwrite", "overwrite=True")])
def test_run_options_in_a_config_say_where_they_belong(key, how):
    with pytest.raises(HsxError, match=rf"unknown keys \['{key}'\]; {key} \(hsx.extract\(cfg, {how}\), or --{key}\) "
                                       "belong to a run"):
        hsx.ExtractConfig.from_dict({"model": "m", key: True})
    assert "progress=False" in hsx.ExtractConfig.__doc__
