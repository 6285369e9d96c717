"""The runner contract is all an engine needs: a fourth engine, registered from outside the package,
runs ``hsx extract`` end to end, and its output passes ``hsx verify --recompute`` (every row against a
teacher-forced forward of the model).

The stub engine (``tests/stub_engine/``) runs no model: it hands back the rows the transformers engine
stored for the same prompts (speculative generation with the demo's draft, and prefill). Its output
must equal the source's bit for bit and be what an independent forward computes.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.engine import registry
from hsx.engine.contract import Runner
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from hsx.shards.reader import open_shards

PROMPTS = ["the cat sat on the mat", "hidden states of every token", "a", "speculative decoding drafts and verifies",
           "one two three four five six seven"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stub_engine():
    registry.register("stub", "stub_engine.runner:StubRunner")
    yield
    registry.unregister("stub")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("registry")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=4, hidden_size=64, vocab_size=len(tok), seed=3, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for name, m in (("target", target), ("draft", make_layerskip_draft(target, num_layers=2))):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(PROMPTS)))
    return {"root": root, "target": str(root / "target"), "draft": str(root / "draft"), "data": str(data)}


@pytest.mark.parametrize("mode", ["generate", "prefill"])
def test_a_registered_fourth_engine_runs_hsx_extract_end_to_end(models, stub_engine, mode):
    root = models["root"]
    common = ["--model", models["target"], "--dataset", models["data"], "--id-field", "id", "--mode", mode,
              "--layers", "final,eagle3,0", "--device", "cpu", "--model-dtype", "float32", "-q"]
    spec = ["--draft-model", models["draft"], "--spec-num-steps", "3", "--max-new-tokens", "7"] if mode == "generate" else []
    src, out = root / f"src-{mode}", root / f"stub-{mode}"
    res = CliRunner().invoke(app, ["extract", *common, *spec, "-o", str(src)])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["extract", *common, "--engine", "stub", "--engine-arg", f"rows_from={src}",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output

    a, b = open_shards(str(src)), open_shards(str(out))
    assert b.metadata["engine"] == {"name": "stub", "rows_from": str(src)}
    assert len(a) == len(b) == len(PROMPTS)
    assert [s.sample_id for s in b] == [s.sample_id for s in a]  # source order, though the stub answers in reverse
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and x.prompt_len == y.prompt_len
        assert x.finish_reason == y.finish_reason
        for name in ("final", "eagle3", "b0"):
            assert torch.equal(x.hidden(name), y.hidden(name)), (x.sample_id, name)
    if mode == "generate":
        assert all(torch.equal(torch.as_tensor(x.accept_lens), torch.as_tensor(y.accept_lens)) for x, y in zip(a, b))

    res = CliRunner().invoke(app, ["verify", str(out), "--recompute", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "recompute: OK" in res.output


def test_an_unknown_engine_is_refused_naming_the_known_ones(models, tmp_path):
    res = CliRunner().invoke(app, ["extract", "--model", models["target"], "--dataset", models["data"],
                                   "--engine", "stub", "-o", str(tmp_path / "o")])
    assert isinstance(res.exception, HsxError), res.output  # hsx.cli.main prints it as "error: ..." and exits 2
    assert "unknown engine 'stub'; expected one of hf, sglang, vllm" in str(res.exception)


def test_the_engines_own_checks_run_before_anything_loads(models, stub_engine, tmp_path):
    cfg = ExtractConfig(model=models["target"], dataset=models["data"], output=str(tmp_path / "o"), engine="stub")
    with pytest.raises(HsxError, match="--engine stub takes one engine argument, rows_from=DIR"):
        extract(cfg, progress=False)
    assert not (tmp_path / "o").exists()


def test_every_registered_runner_states_the_contract():
    for name in registry.ENGINES:
        cls = registry.runner_class(name)
        assert issubclass(cls, Runner) and cls.name == name
        assert cls.id_reading.rule in ("sglang", "vllm")
        assert not getattr(cls, "__abstractmethods__", None), (name, cls.__abstractmethods__)
