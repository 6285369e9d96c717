"""Which rule a head's EAGLE3 layer ids follow: the ``hsx`` marker, its resolution per engine, the converter
to vLLM's head format (``hsx export vllm-head``), and the engines' plans, without SGLang or vLLM.

The same head config names boundaries ``ids + 1`` under SGLang's rule (and the transformers engine's,
which runs SGLang's heads) and ``ids`` under vLLM's. A head records its rule in
``"hsx": {"aux_layer_ids_rule": ..., "aux_boundaries": [...]}``; :func:`resolve_head_layers` gives
the boundaries and the ids an engine must read. The vLLM lane (tests/test_vllm_heads.py) runs the
converted head on a real vLLM against the transformers engine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from typer.testing import CliRunner

from hsx.align import ModelShape
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.spec_models import build_spec_models
from hsx.heads.vllm_head import convert_vllm_head, write_ids_copy
from hsx.heads.load import load_eagle3_head
from hsx.heads.layer_ids import (eagle3_ids_as_boundaries, head_marker, resolve_head_layers, sglang_boundaries)
from hsx.engine.registry import runner_class
from hsx.errors import HsxError

ROOT = Path(__file__).resolve().parents[1]
L = 8


def resolve(config, engine: str, model_type: str, num_layers: int, **kwargs):
    """A head's ids resolved for ``engine`` by the reading its runner states (``Runner.id_reading``)."""
    return resolve_head_layers(config, runner_class(engine).id_reading, model_type, num_layers, **kwargs)


def reading(engine: str):
    return runner_class(engine).id_reading


def rule(engine: str) -> str:
    return reading(engine).rule


def head_config(ids=(1, 3, 5), marker=None, top=None) -> dict:
    ids = {} if ids is None else {"eagle_aux_hidden_state_layer_ids": list(ids)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": ids}
    if marker is not None:
        cfg["hsx"] = marker
    if top is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(top)
    return cfg


# ---- resolution --------------------------------------------------------------------------------

@pytest.mark.parametrize("engine,bounds,ids", [("hf", (2, 4, 6), (1, 3, 5)), ("sglang", (2, 4, 6), (1, 3, 5)),
                                               ("vllm", (1, 3, 5), (1, 3, 5))])
def test_an_unmarked_head_keeps_each_engines_rule(engine, bounds, ids):
    got = resolve(head_config(), engine, "llama", L)
    assert (got.boundaries, got.ids, got.marked, got.needs_rewrite) == (bounds, ids, False, False)
    assert got.describe()["rule_from"] == "engine default"
    assert got.rule == ("vllm" if engine == "vllm" else "sglang")


@pytest.mark.parametrize("engine,ids,rewrite", [("hf", (1, 3, 5), False), ("sglang", (1, 3, 5), False),
                                                ("vllm", (2, 4, 6), True)])
def test_a_head_marked_sglang_names_the_same_boundaries_everywhere(engine, ids, rewrite):
    got = resolve(head_config(marker={"aux_layer_ids_rule": "sglang", "aux_boundaries": [2, 4, 6]}),
                              engine, "llama", L)
    assert (got.boundaries, got.ids, got.needs_rewrite, got.marked, got.rule) == ((2, 4, 6), ids, rewrite, True, "sglang")


@pytest.mark.parametrize("engine,ids,rewrite", [("hf", (2, 4, 6), False), ("sglang", (1, 3, 5), True),
                                                ("vllm", (2, 4, 6), False)])
def test_a_head_marked_vllm_names_the_same_boundaries_everywhere(engine, ids, rewrite):
    got = resolve(head_config((2, 4, 6), {"aux_layer_ids_rule": "vllm"}), engine, "llama", L)
    assert (got.boundaries, got.ids, got.needs_rewrite) == ((2, 4, 6), ids, rewrite)
    assert got.describe() == {"aux_layer_ids_rule": "vllm", "rule_from": "marker", "head_ids": [2, 4, 6],
                              "boundaries": [2, 4, 6], "engine_ids": list(ids)}


def test_sglangs_model_rules_apply_to_sglang_marked_heads():
    # GPT-OSS keeps ids as they are when the largest is L; the DeepSeek-V2 family unless the first id is 1
    gpt = resolve(head_config((2, 5, 8), {"aux_layer_ids_rule": "sglang"}), "vllm", "gpt_oss", L)
    assert gpt.boundaries == (2, 5, 8) and gpt.ids == (2, 5, 8) and not gpt.needs_rewrite
    ds = resolve(head_config((2, 4, 6), {"aux_layer_ids_rule": "sglang"}), "vllm", "deepseek_v3", L)
    assert ds.boundaries == (2, 4, 6) and not ds.needs_rewrite
    back = resolve(head_config((2, 4, 6), {"aux_layer_ids_rule": "vllm"}), "sglang", "deepseek_v3", L)
    assert back.ids == (1, 3, 5) and sglang_boundaries(back.ids, "deepseek_v3", L) == (2, 4, 6)  # first id 1: + 1


def test_a_transformers_config_carries_the_marker(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, **head_config(
        (2, 4, 6), {"aux_layer_ids_rule": "vllm", "aux_boundaries": [2, 4, 6]})}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert head_marker(loaded)["aux_layer_ids_rule"] == "vllm"
    assert resolve(loaded, "sglang", "llama", L).ids == (1, 3, 5)


@pytest.mark.parametrize("config,engine,match", [
    (head_config(marker={"aux_layer_ids_rule": "sglang", "aux_boundaries": [1, 3, 5]}), "hf",
     r"name boundaries \[2, 4, 6\] by the sglang rule .* records aux_boundaries \[1, 3, 5\]"),
    (head_config(marker={"aux_layer_ids_rule": "SGLang"}), "hf", "is not a layer-id marker"),
    (head_config(marker="vllm"), "vllm", "is not a layer-id marker"),
    (head_config(marker={"aux_layer_ids_rule": "vllm", "aux_boundaries": "2,4,6"}), "vllm", "not a list of boundaries"),
    (head_config(None, {"aux_layer_ids_rule": "vllm", "aux_boundaries": [2, 4, 6]}), "vllm", "has no eagle_aux"),
    (head_config((1, 3, 5), top=(2, 4, 6)), "vllm", "at its top level and .* in eagle_config"),
    (head_config((1, 3, 8)), "hf", r"\[9\] are outside 0..8"),
    (head_config((0, 3, 6), {"aux_layer_ids_rule": "vllm"}), "sglang", "SGLang cannot capture boundaries"),
    (head_config(), "ray", "unknown engine"),
])
def test_resolution_refusals(config, engine, match):
    with pytest.raises(HsxError, match=match):
        resolve(config, engine, "llama", L)


def test_ids_given_without_a_head_follow_the_capturing_engines_rule():
    assert eagle3_ids_as_boundaries([2, 4, 6], rule("vllm"), L)[0] == (2, 4, 6)
    assert eagle3_ids_as_boundaries([1, 3, 5], rule("hf"), L)[0] == (2, 4, 6)
    assert eagle3_ids_as_boundaries([1, 3, 5], rule("sglang"), L)[0] == (2, 4, 6)
    with pytest.raises(HsxError, match="vLLM needs 3 ids in 0..8"):
        eagle3_ids_as_boundaries([2, 4, 9], rule("vllm"), L)


# ---- the converter ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_spec_models(tmp_path_factory.mktemp("ids") / "spec")


@pytest.fixture(scope="module")
def converted(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-heads")
    return (convert_vllm_head(models.eagle3, root / "eagle3", model=str(models.target)),
            convert_vllm_head(models.eagle, root / "eagle", model=str(models.target)))


def read(path: Path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def test_the_eagle3_head_converted(models, converted):
    done, _ = converted
    src_cfg, src = read(models.eagle3)
    cfg, w = read(done.dst)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert cfg["hsx"] == {"aux_layer_ids_rule": "vllm", "aux_boundaries": [2, 4, 6], "converted_from": {
        "path": str(models.eagle3), "aux_layer_ids_rule": "sglang", "aux_layer_ids": [1, 3, 5]}}
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == cfg["vocab_size"]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    assert {k: v for k, v in cfg.items() if k not in ("hsx", "eagle_config")} == \
        {k: v for k, v in src_cfg.items() if k != "eagle_config"}
    assert set(src) - set(w) == {"d2t", "t2d", "embed_tokens.weight"} and set(w) <= set(src)
    for k in set(w) - {"lm_head.weight"}:
        assert torch.equal(w[k], src[k]), k
    # the folded lm_head: the row of target id d + d2t[d] is the draft row d
    hot = torch.arange(src["d2t"].numel()) + src["d2t"]
    assert not torch.equal(hot, torch.arange(hot.numel()))  # the demo's draft vocabulary is permuted
    assert torch.equal(w["lm_head.weight"][hot], src["lm_head.weight"])
    # and so logits over target ids are the SGLang head's, placed by d2t
    h = torch.randn(5, src["lm_head.weight"].shape[1])
    placed = torch.empty(5, hot.numel())
    placed[:, hot] = h @ src["lm_head.weight"].T
    assert torch.allclose(h @ w["lm_head.weight"].T, placed)
    assert done.folded and not done.kept_d2t and done.boundaries == [2, 4, 6]


def test_the_eagle_head_converted(models, converted):
    _, done = converted
    src_cfg, src = read(models.eagle)
    cfg, w = read(done.dst)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hsx"]["aux_layer_ids_rule"] == "vllm" and "aux_boundaries" not in cfg["hsx"]
    assert set(src) - set(w) == {"fc.bias", "lm_head.weight", "embed_tokens.weight"}
    assert all(torch.equal(w[k], src[k]) for k in w)


def test_both_engines_read_the_converted_head_as_the_original(models, converted):
    """The transformers engine (and SGLang's reading, by the marker) puts the converted head's ids [2, 4, 6]
    at boundaries 2, 4, 6, as the original's [1, 3, 5]; its drafts over target ids are the original's."""
    from hsx.engine.families import load_causal_lm
    from hsx.engine.hf.engine import head_aux_boundaries

    target = load_causal_lm(str(models.target), torch.float32, what="target model").eval()
    a = load_eagle3_head(models.eagle3, target, torch.float32)
    b = load_eagle3_head(converted[0].dst, target, torch.float32)
    assert head_aux_boundaries(a, target) == head_aux_boundaries(b, target) == (2, 4, 6)
    normed = torch.randn(1, 3, a.hidden_size)
    assert torch.equal(a.target_logits(normed), b.target_logits(normed))


def test_the_cli(models, tmp_path):
    run = CliRunner().invoke(app, ["export", "vllm-head", str(models.eagle3), str(tmp_path / "h"), "--model",
                                   str(models.target)])
    assert run.exit_code == 0, run.output
    assert "aux layer ids [1, 3, 5] (sglang rule) = boundaries [2, 4, 6] -> vLLM ids [2, 4, 6]" in run.output
    again = CliRunner().invoke(app, ["export", "vllm-head", str(models.eagle3), str(tmp_path / "h")])
    assert isinstance(again.exception, HsxError) and "give --force" in str(again.exception)
    forced = CliRunner().invoke(app, ["export", "vllm-head", str(models.eagle3), str(tmp_path / "h"), "--force",
                                      "--model", str(models.target)])
    assert forced.exit_code == 0, forced.output


def edited(src: Path, dst: Path, config=None, drop=(), add=None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(dst / "model.safetensors"))
    for k in drop:
        del w[k]
    w.update(add or {})
    save_file(w, str(dst / "model.safetensors"))
    return dst


def _d2t(models):
    return load_file(str(models.eagle3 / "model.safetensors"))["d2t"]


@pytest.mark.parametrize("which,edit,match", [
    ("eagle3", lambda m: dict(add={"d2t": torch.zeros_like(_d2t(m)).index_fill_(0, torch.tensor([1]), -1)}),
     "a same-size d2t must be a permutation"),
    ("eagle3", lambda m: dict(add={"d2t": _d2t(m) + 3}), "outside 0.."),
    ("eagle3", lambda m: dict(drop=["midlayer.mlp.up_proj.weight"]), r"missing tensors \['midlayer.mlp.up_proj.weight'\]"),
    ("eagle3", lambda m: dict(add={"mask_hidden": torch.zeros(3)}), r"neither engine reads .*mask_hidden"),
    ("eagle3", lambda m: dict(add={"fc.bias": torch.ones(128)}), "fc.bias is not zero"),
    ("eagle3", lambda m: dict(config={"norm_before_residual": True}), "norm_before_residual is set"),
    ("eagle3", lambda m: dict(config={"vocab_size": 100}), "vocab_size 100, the target's vocabulary is"),
    ("eagle3", lambda m: dict(add={"fc.weight": torch.zeros(128, 256)}), r"fc.weight has shape \(128, 256\)"),
    ("eagle3", lambda m: dict(config={"hsx": {"aux_layer_ids_rule": "vllm"}}), "in vLLM's format already"),
    ("eagle", lambda m: dict(add={"fc.bias": torch.full((128,), 0.5)}), "fc.bias is not zero"),
    ("eagle", lambda m: dict(add={"layers.0.input_layernorm.weight": torch.ones(128)}), "has no input norm"),
    ("eagle", lambda m: dict(drop=["fc.weight"]), r"missing tensors \['fc.weight'\]"),
])
def test_converter_refusals(models, tmp_path, which, edit, match):
    bad = edited(getattr(models, which), tmp_path / "bad", **edit(models))
    with pytest.raises(HsxError, match=match) as e:
        convert_vllm_head(bad, tmp_path / "out", model=str(models.target))
    assert str(bad) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_converter_refuses_what_it_cannot_read(models, tmp_path):
    with pytest.raises(HsxError, match="expected LlamaForCausalLMEagle3"):
        convert_vllm_head(models.target, tmp_path / "out")
    with pytest.raises(HsxError, match="give --model TARGET"):  # an unmarked head: SGLang's rule needs the target
        convert_vllm_head(models.eagle3, tmp_path / "out")
    with pytest.raises(HsxError, match="is the source head"):
        convert_vllm_head(models.eagle3, models.eagle3, model=str(models.target))


def test_a_smaller_draft_vocabulary_keeps_its_d2t(models, tmp_path):
    cfg, w = read(models.eagle3)
    keep = torch.tensor([7, 3, 11, 40, 2])
    small = edited(models.eagle3, tmp_path / "small", config={"draft_vocab_size": 5},
                   add={"lm_head.weight": w["lm_head.weight"][:5].clone(), "d2t": keep - torch.arange(5)})
    done = convert_vllm_head(small, tmp_path / "out", model=str(models.target))
    _, out = read(tmp_path / "out")
    assert done.kept_d2t and not done.folded and torch.equal(out["d2t"], keep - torch.arange(5))
    twice = edited(small, tmp_path / "twice", add={"d2t": torch.tensor([7, 3, 3, 40, 2]) - torch.arange(5)})
    with pytest.raises(HsxError, match="two draft ids to the same target id"):
        convert_vllm_head(twice, tmp_path / "out2", model=str(models.target))


def test_the_demo_trainers_head_is_marked_sglang_and_converts_without_the_target(models, tmp_path):
    path = ROOT / "scripts" / "train_eagle3_demo.py"
    spec = importlib.util.spec_from_file_location("train_eagle3_demo", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    tcfg = AutoConfig.from_pretrained(models.target)
    head = demo.DraftHead(tcfg.hidden_size, tcfg.vocab_size)
    out = demo.export_sglang_head(head, tmp_path / "head", str(models.target), (2, 4, 6), False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hsx"] == {"aux_layer_ids_rule": "sglang", "aux_boundaries": [2, 4, 6]}
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    from hsx.engine.families import load_causal_lm
    from hsx.engine.hf.engine import head_aux_boundaries

    target = load_causal_lm(str(models.target), torch.float32, what="target model").eval()
    assert head_aux_boundaries(load_eagle3_head(out, target, torch.float32), target) == (2, 4, 6)
    done = convert_vllm_head(out, tmp_path / "vllm")  # marked with its boundaries: no --model needed
    assert done.ids == [2, 4, 6] and done.source_rule == "sglang"


def test_an_ids_copy_links_the_weights(models, tmp_path):
    copy = write_ids_copy(models.eagle3, tmp_path / "copy", [2, 4, 6], "vllm", (3, 5, 7))
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert cfg["hsx"]["aux_layer_ids_rule"] == "vllm" and cfg["hsx"]["aux_boundaries"] == [3, 5, 7]
    assert (copy / "model.safetensors").is_symlink()
    assert (copy / "model.safetensors").resolve() == (models.eagle3 / "model.safetensors").resolve()


# ---- the engines' plans (no SGLang, no vLLM) ----------------------------------------------------

def _runner(cls, models, **kw):
    """An engine runner with its configuration read, its engine never started (``_plan`` only)."""
    runner = object.__new__(cls)
    runner.cfg = ExtractConfig(model=str(models.target), dataset="x", device="cpu", model_dtype="float32",
                               **{"layers": "final,eagle3", **kw})
    runner.model_config = AutoConfig.from_pretrained(models.target)
    runner.shape = ModelShape.from_config(runner.model_config)
    runner._requests = 0
    return runner


def _marked(models, tmp_path, rule, bounds=(2, 4, 6)) -> Path:
    return edited(models.eagle3, tmp_path / f"marked-{rule}",
                  config={"hsx": {"aux_layer_ids_rule": rule, "aux_boundaries": list(bounds)}})


def test_sglang_is_handed_a_copy_with_its_ids_for_a_vllm_head(models, converted, tmp_path):
    from hsx.engine.sglang.runner import SGLangRunner

    vllm_head = converted[0].dst
    runner = _runner(SGLangRunner, models, draft_model=str(vllm_head), spec_algorithm="EAGLE3")
    plan = runner._plan(AutoConfig.from_pretrained(vllm_head))
    read_by_sglang = Path(plan.engine_args["speculative_draft_model_path"])
    assert read_by_sglang != vllm_head
    cfg = json.loads((read_by_sglang / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # SGLang: boundary = id + 1
    assert cfg["hsx"]["aux_layer_ids_rule"] == "sglang" and cfg["hsx"]["aux_boundaries"] == [2, 4, 6]
    eagle3 = next(g for g in plan.groups if g.name == "eagle3")
    assert eagle3.sources == (2, 4, 6) and "vllm rule" in eagle3.rule and "SGLang capture ids [1, 3, 5]" in eagle3.rule
    runner.plan = plan
    aux = runner.describe_speculative()["aux_layers"]
    assert aux["aux_layer_ids_rule"] == "vllm" and aux["engine_ids"] == [1, 3, 5] and aux["copy_read"] == str(read_by_sglang)
    # its own SGLang head: handed over as it is, recorded as read by SGLang's rule
    runner = _runner(SGLangRunner, models, draft_model=str(models.eagle3), spec_algorithm="EAGLE3")
    plan = runner._plan(AutoConfig.from_pretrained(models.eagle3))
    assert plan.engine_args["speculative_draft_model_path"] == str(models.eagle3)
    assert next(g for g in plan.groups if g.name == "eagle3").sources == (2, 4, 6)
    assert plan.head.describe()["rule_from"] == "engine default" and plan.head.rule == "sglang"


def test_sglang_refuses_an_eagle_head_converted_for_vllm(models, converted):
    from hsx.engine.sglang.runner import SGLangRunner

    runner = _runner(SGLangRunner, models, draft_model=str(converted[1].dst), spec_algorithm="EAGLE", layers="final")
    with pytest.raises(HsxError, match="head in vLLM's format"):
        runner._plan(AutoConfig.from_pretrained(converted[1].dst))


def test_vllm_refuses_a_head_marked_sglang_naming_the_conversion(models, tmp_path):
    from hsx.engine.vllm.runner import VLLMRunner

    head = _marked(models, tmp_path, "sglang")
    runner = _runner(VLLMRunner, models, draft_model=str(head), spec_algorithm="EAGLE3")
    with pytest.raises(HsxError) as e:
        runner._plan(AutoConfig.from_pretrained(head))
    msg = str(e.value)
    assert f"hsx export vllm-head {head} DST --model {models.target}" in msg
    assert "SGLang's rule (boundaries [2, 4, 6])" in msg and "feed it boundaries [1, 3, 5]" in msg


def test_vllm_plans_the_converted_head_and_records_the_rule(models, converted):
    from hsx.engine.vllm.runner import VLLMRunner

    head = converted[0].dst
    runner = _runner(VLLMRunner, models, draft_model=str(head), spec_algorithm="EAGLE3")
    runner.plan = plan = runner._plan(AutoConfig.from_pretrained(head))
    assert plan.aux == (2, 4, 6) and not plan.set_aux
    assert plan.engine_args["speculative_config"]["model"] == str(head)
    eagle3 = next(g for g in plan.groups if g.name == "eagle3")
    assert eagle3.sources == (2, 4, 6) and "vllm rule" in eagle3.rule and "hsx marker" in eagle3.rule
    assert runner.describe_speculative()["aux_layers"] == {
        "aux_layer_ids_rule": "vllm", "rule_from": "marker", "head_ids": [2, 4, 6], "boundaries": [2, 4, 6],
        "engine_ids": [2, 4, 6]}
    # an unmarked head: vLLM's own rule, as before the marker, and recorded as such
    unmarked = json.loads((head / "config.json").read_text())
    unmarked.pop("hsx")
    runner = _runner(VLLMRunner, models, draft_model=str(head), spec_algorithm="EAGLE3")
    plan = runner._plan(AutoConfig.for_model(**{k: v for k, v in unmarked.items() if k != "model_type"},
                                             model_type="llama"))
    assert plan.aux == (2, 4, 6) and plan.head.describe()["rule_from"] == "engine default"


def test_the_transformers_engine_records_the_rule_it_applied(models, converted):
    from hsx.engine.hf.runner import HFRunner

    for head, rule, source in ((models.eagle3, "sglang", "engine default"), (converted[0].dst, "vllm", "marker")):
        runner = HFRunner(ExtractConfig(model=str(models.target), draft_model=str(head), dataset="x", device="cpu",
                                        model_dtype="float32", layers="final,eagle3"))
        eagle3 = next(g for g in runner.groups if g.name == "eagle3")
        aux = runner.describe_speculative()["aux_layers"]
        assert eagle3.sources == (2, 4, 6) and runner.engine.aux_sources == (2, 4, 6)
        assert (aux["aux_layer_ids_rule"], aux["rule_from"], aux["boundaries"]) == (rule, source, [2, 4, 6])


# ---- a run over an hsx output's tokens --------------------------------------------------------

def test_a_stored_tokens_run_plans_eagle3_by_the_engines_rule(models):
    from hsx.engine.replay.runner import planned_groups

    shape = ModelShape(L, 128)
    cfg = ExtractConfig(model="m", dataset="d", layers="final,eagle3", eagle3_layer_ids=[2, 4, 6])
    assert next(g for g in planned_groups(dataclasses.replace(cfg, engine="vllm"), shape, reading("vllm"))
                if g.name == "eagle3").sources == (2, 4, 6)
    assert next(g for g in planned_groups(cfg, shape, reading("hf")) if g.name == "eagle3").sources == (3, 5, 7)
    assert next(g for g in planned_groups(dataclasses.replace(cfg, eagle3_layer_ids=None), shape, reading("hf"))
                if g.name == "eagle3").sources == (2, 4, 5)


def test_a_stored_tokens_run_with_vllms_ids_checks_the_right_boundaries(models, tmp_path, monkeypatch):
    """Over an output whose ``eagle3`` is boundaries 2, 4, 6, ``--engine vllm --eagle3-layer-ids 2,4,6`` names the
    same boundaries (it was refused before: the ids were read with SGLang's + 1). The engine here is the
    transformers engine standing in for vLLM, with the columns vLLM's rule makes of those ids."""
    import hsx
    from hsx.engine import registry as loader
    from hsx.engine.hf.runner import HFRunner
    from hsx.engine.replay.runner import StoredTokensRunner
    from hsx.run.pipeline import extract

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("the cat sat", "a b c d e f", "hidden states")))
    src = tmp_path / "src"
    common = dict(model=str(models.target), device="cpu", model_dtype="float32", dtype="float32",
                  layers="final,eagle3", mode="prefill")
    extract(ExtractConfig(dataset=str(data), output=str(src), eagle3_layer_ids=[1, 3, 5], **common), progress=False)
    assert hsx.open(str(src)).metadata["layers"][1]["sources"] == [2, 4, 6]

    def as_vllm(c):  # vLLM's columns for ids [2, 4, 6]: the transformers engine with the ids that make them there
        assert c.engine == "vllm" and c.eagle3_layer_ids == [2, 4, 6]
        return HFRunner(dataclasses.replace(c, engine="hf", eagle3_layer_ids=[1, 3, 5]))

    monkeypatch.setattr(loader, "_runner_of", as_vllm)
    again = tmp_path / "again"
    cfg = ExtractConfig(dataset=str(src), output=str(again), eagle3_layer_ids=[2, 4, 6], engine="vllm", **common)
    extract(cfg, progress=False, checked=True)  # every row of both columns checked against the source's
    out = hsx.open(str(again))
    assert len(out) == 3 and out.metadata["layers"][1]["sources"] == [2, 4, 6]
    runner = StoredTokensRunner(cfg, as_vllm, reading("vllm"))
    assert [(s.name, s.source) for s in runner.shared] == [("final", "final"), ("eagle3", 2), ("eagle3", 4),
                                                            ("eagle3", 6)]
    with pytest.raises(HsxError, match=r"column 'eagle3' would hold sources \[3, 5, 7\]"):
        StoredTokensRunner(dataclasses.replace(cfg, engine="hf"), as_vllm, reading("hf"))  # the transformers engine: + 1
