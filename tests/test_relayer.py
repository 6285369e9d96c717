"""``hsx extract --dataset OUT``: an hsx output's own tokens as the dataset of a new, teacher-forced run.

A generate-mode source (chain speculation) and a prefill source under ``--keep loss`` are run again
with a boundary column added. The new output must have the source's samples field for field and
its rows at the source's positions; the new column must equal the test's own oracle; the columns
both outputs hold must agree with the source; ``hsx verify --recompute`` must pass on it. A source
whose rows were tampered with, a model with another config and one with the same config but
other weights are refused, naming what is wrong.
"""

from __future__ import annotations

import json
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
from hsx.compare.agreement import agreement_tolerance, disagreement
from hsx.compare.check import typical_norm
from hsx.compare.tolerance import tolerance_for
from hsx.shards.manifest import load_manifest, save_manifest
from oracle import oracle_sources
from shard_fixtures import rewrite

NUM_LAYERS = 8
ROWS = [
    {"id": "chat-a", "messages": [{"role": "user", "content": "How do tides work?"},
                                  {"role": "assistant", "content": "The Moon pulls the sea towards it."}]},
    {"id": "text-b", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "blank", "text": "   "},  # an error record in both modes
    {"id": "chat-c", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
                                  {"role": "assistant", "content": "Green, like grass in spring."}]},
    {"id": "text-d", "text": "Bees"},
    {"id": "chat-e", "messages": [{"role": "user", "content": "What is bread made of, and why does it rise?"}]},
]
BASE = ("sample_id", "source_index", "prompt_len", "finish_reason", "verify_steps")
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The demo's tiny target and layer-skip draft (as tests/test_notebook.py builds them), and the data."""
    root = tmp_path_factory.mktemp("relayer")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=len(tok), seed=1,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for name, m in (("target", target), ("draft", make_layerskip_draft(target, num_layers=2))):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": target, "data": str(data),
            "root": root, "tokenizer": tok}


@pytest.fixture(scope="module")
def generated(models) -> Path:
    """The expensive run: speculative generation, columns final, eagle3 (boundaries 2, 4, 5) and boundary 0."""
    out = models["root"] / "generated"
    extract(ExtractConfig(model=models["target"], draft_model=models["draft"], dataset=models["data"], id_field="id",
                          output=str(out), layers="final,eagle3,0", max_new_tokens=8, batch_size=4, spec_num_steps=3,
                          spec_topk=1, spec_num_draft_tokens=4), progress=False)
    return out


@pytest.fixture(scope="module")
def relayered(models, generated) -> Path:
    """The generated output's tokens again, through the CLI, with boundary L added: what speculators needs."""
    out = models["root"] / "relayered"
    result = runner.invoke(app, ["extract", "--model", models["target"], "--dataset", str(generated), "--output",
                                 str(out), "--layers", f"final,eagle3,{NUM_LAYERS}", "--batch-size", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def prefilled(models) -> Path:
    out = models["root"] / "prefilled"
    extract(ExtractConfig(model=models["target"], dataset=models["data"], id_field="id", output=str(out), mode="prefill",
                          keep="loss", layers="final,0"), progress=False)
    return out


def assert_same_samples(a: Path, b: Path) -> None:
    """Every field of every sample, the positions and the error records of ``b`` are ``a``'s."""
    x, y = hsx.open(a), hsx.open(b)
    assert x.sample_ids == y.sample_ids and len(x) > 0
    for s, t in zip(x, y):
        for name in BASE:
            assert getattr(s, name) == getattr(t, name), (s.sample_id, name)
        for name in ("input_ids", "loss_mask", "positions"):
            assert torch.equal(getattr(s, name), getattr(t, name)), (s.sample_id, name)
        assert (s.accept_lens is None) == (t.accept_lens is None)
        assert s.accept_lens is None or torch.equal(s.accept_lens, t.accept_lens), s.sample_id
    for key in ("mode", "keep", "speculative", "sampling"):
        assert x.metadata.get(key) == y.metadata.get(key), key
    assert [(e.sample_id, e.source_index) for e in x.errors] == [(e.sample_id, e.source_index) for e in y.errors]
    assert all(f.reason.endswith(e.reason) for e, f in zip(x.errors, y.errors))


def within(stored: torch.Tensor, reference: torch.Tensor, rel: float) -> bool:
    """Every row within ``rel`` of the reference, relative to ``max(||r||, median ||r||)`` as the recompute measures."""
    r = reference.float()
    if r.shape[0] == 0:  # a sample whose keep rule stores no row
        return stored.shape[0] == 0
    floor = typical_norm(r[None], torch.ones(1, r.shape[0], dtype=torch.bool))[0]
    err = (stored.float() - r).norm(dim=-1) / torch.maximum(r.norm(dim=-1), floor)
    return bool((err <= rel).all())


def assert_rows_like_the_oracle(model, out: Path, column: str, source) -> None:
    ds = hsx.open(out)
    limit = tolerance_for("bfloat16", "float32", "float32").rel
    for s in ds:
        want = oracle_sources(model, s.input_ids.long())[source][s.positions]
        assert within(s.hidden(column), want, limit), (s.sample_id, column)


def assert_shared_agree(a: Path, b: Path, columns) -> None:
    limit = tolerance_for("bfloat16", "float32", "float32").rel + 2.0**-8  # both sides rounded to bfloat16
    x, y = hsx.open(a), hsx.open(b)
    for s, t in zip(x, y):
        for name in columns:
            assert within(s.hidden(name), t.hidden(name), limit), (s.sample_id, name)


def verify_recompute(out: Path) -> dict:
    result = runner.invoke(app, ["verify", str(out), "--recompute", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --- a generate-mode source ------------------------------------------------------------------------

def test_generated_tokens_again_have_the_source_samples(generated, relayered):
    assert_same_samples(generated, relayered)
    meta = hsx.open(relayered).metadata
    src = load_manifest(generated)
    assert meta["mode"] == "generate" and meta["alignment"]["covers"] == "0..N-2"
    assert [g["name"] for g in meta["layers"]] == ["final", "eagle3", f"b{NUM_LAYERS}"]
    origin = meta["dataset"]["tokens_from"]
    assert origin["output"] == str(generated) and origin["config_hash"] == src.config_hash
    assert origin["model_config_sha256"] == src.metadata["model"]["config_sha256"] == meta["model"]["config_sha256"]
    assert origin["dataset"] == src.metadata["dataset"] and meta["dataset"]["fingerprint"] == origin["manifest_fingerprint"]
    assert hsx.open(relayered).errors[0].sample_id == "blank"


def test_the_speculators_export_refused_for_the_source_takes_the_new_output(generated, relayered, tmp_path):
    from hsx.export import export_speculators

    with pytest.raises(HsxError):  # no column holds boundary L
        export_speculators(generated, tmp_path / "from-source", progress=False)
    summary = export_speculators(relayered, tmp_path / "speculators", progress=False)
    assert summary.samples == len(hsx.open(relayered)) and summary.target_layer_ids == [2, 4, 5]


def test_the_new_boundary_equals_the_oracle(models, relayered):
    assert_rows_like_the_oracle(models["model"], relayered, f"b{NUM_LAYERS}", NUM_LAYERS)


def test_shared_columns_agree_with_the_source(generated, relayered):
    assert_shared_agree(generated, relayered, ["final", "eagle3"])


def test_verify_recompute_passes_on_the_new_output(relayered):
    report = verify_recompute(relayered)
    assert report["recompute"]["rows"] > 0 and report["ok"]


def test_a_second_run_resumes_and_an_interrupted_one_finishes_bit_for_bit(models, generated, relayered, monkeypatch, tmp_path):
    from hsx.engine.replay.runner import StoredTokensRunner

    cfg = ExtractConfig(model=models["target"], dataset=str(generated), output=str(relayered),
                        layers=f"final,eagle3,{NUM_LAYERS}", batch_size=2)
    again = extract(cfg, progress=False)
    assert (again.samples, again.resumed) == (0, len(ROWS))
    # windows of 2 source rows: the run stops inside the third, after the first two are written
    cfg = ExtractConfig(**{**cfg.to_dict(), "output": str(tmp_path / "interrupted"), "window": 2})
    extract(ExtractConfig(**{**cfg.to_dict(), "output": str(tmp_path / "whole")}), progress=False)
    out, check, calls = Path(cfg.output), StoredTokensRunner._check, []

    def interrupt_at_the_fourth(self, prompt, sample):
        calls.append(prompt.sample_id)
        if len(calls) == 4:
            raise KeyboardInterrupt
        check(self, prompt, sample)

    monkeypatch.setattr(StoredTokensRunner, "_check", interrupt_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        extract(cfg, progress=False)
    monkeypatch.setattr(StoredTokensRunner, "_check", check)
    partial = load_manifest(out)
    assert not partial.complete and 0 < len(partial.done_ids()) < len(ROWS)
    assert extract(cfg, progress=False).resumed == len(partial.done_ids())
    a, b = hsx.open(tmp_path / "whole"), hsx.open(out)
    assert a.sample_ids == b.sample_ids
    for s, t in zip(a, b):
        for name in a.columns:
            assert torch.equal(s.hidden(name).view(torch.int16), t.hidden(name).view(torch.int16)), (s.sample_id, name)


def test_the_online_feed_over_the_tokens_gives_the_extracted_rows(models, generated, relayered):
    from hsx.data.stored import adopt_source

    cfg = ExtractConfig(model=models["target"], dataset=str(generated), layers=f"final,eagle3,{NUM_LAYERS}", batch_size=2)
    with pytest.raises(HsxError, match=r"keeps its max_new_tokens: 128 -> 8 .*adopt_source"):
        list(hsx.stream(cfg).records())
    records = list(hsx.stream(adopt_source(cfg)).records())
    ds = hsx.open(relayered)
    assert [r.sample_id for r in records] == ds.sample_ids
    for r, s in zip(records, ds):
        assert torch.equal(r.hidden[f"b{NUM_LAYERS}"].view(torch.int16), s.hidden(f"b{NUM_LAYERS}").view(torch.int16))


# --- a prefill source under --keep loss ------------------------------------------------------------

def test_prefill_source_with_keep_loss(models, prefilled, tmp_path):
    out = tmp_path / "prefill-b4"
    summary = extract(ExtractConfig(model=models["target"], dataset=str(prefilled), output=str(out), layers="final,4"),
                      progress=False)
    assert summary.samples == len(hsx.open(prefilled)) and summary.errors == 1
    assert_same_samples(prefilled, out)
    meta = hsx.open(out).metadata
    assert meta["mode"] == "prefill" and meta["keep"] == "loss" and meta["speculative"] is None
    assert_rows_like_the_oracle(models["model"], out, "b4", 4)
    assert_shared_agree(prefilled, out, ["final"])
    verify_recompute(out)


# --- refusals ---------------------------------------------------------------------------------------

def test_a_tampered_source_column_is_caught_naming_sample_and_column(generated, tmp_path):
    def shift_final(k, s, hidden):  # rows of chat-c moved by one position: row p holds the state of p-1
        if s.sample_id == "chat-c":
            hidden["final"] = torch.cat([hidden["final"][:1], hidden["final"][:-1]])

    src = rewrite(generated, tmp_path / "tampered", shift_final)
    m = load_manifest(src)
    m.errors = load_manifest(generated).errors  # the rewrite copies samples only
    save_manifest(src, m)
    result = runner.invoke(app, ["extract", "--model", str(generated.parent / "target"), "--dataset", str(src),
                                 "--output", str(tmp_path / "out"), "--layers", "final,8", "--quiet"])
    assert isinstance(result.exception, HsxError), result.output  # hsx's main() prints it as "error: ..."
    message = str(result.exception)
    assert "sample 'chat-c' (source row 3), column 'final'" in message, message
    assert f"hsx verify --recompute {src}" in message
    assert not load_manifest(tmp_path / "out").complete


def test_a_model_with_another_config_is_refused(models, generated, tmp_path):
    other = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=len(models["tokenizer"]), seed=1,
                             rope_theta=500.0)
    other.save_pretrained(tmp_path / "other")
    models["tokenizer"].save_pretrained(tmp_path / "other")
    cfg = ExtractConfig(model=str(tmp_path / "other"), dataset=str(generated), output=str(tmp_path / "out"),
                        layers="final,8")
    with pytest.raises(HsxError, match=r"has a different config from the one .* was made with"):
        extract(cfg, progress=False)


def test_other_weights_under_the_same_config_are_caught_by_the_check(models, generated, tmp_path):
    tok = models["tokenizer"]
    other = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=len(tok), seed=2,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    other.save_pretrained(tmp_path / "retrained")
    tok.save_pretrained(tmp_path / "retrained")
    cfg = ExtractConfig(model=str(tmp_path / "retrained"), dataset=str(generated), output=str(tmp_path / "out"),
                        layers="final,8")
    with pytest.raises(HsxError, match=r"sample '[\w-]+' \(source row \d\), column 'final' of .* rows differ"):
        extract(cfg, progress=False)


@pytest.mark.parametrize("change, message", [
    ({"draft_model": "d"}, r"--draft-model 'd' does not apply; leave it out"),
    ({"id_field": "id", "split": "test"}, r"--id-field 'id', --split 'test' do not apply; leave them out"),
    ({"mode": "prefill"}, r"--mode 'prefill': the hsx output .* was made with mode 'generate'"),
    ({"max_new_tokens": 64}, r"--max-new-tokens 64: .* was made with max_new_tokens 8"),
    ({"layers": "8"}, r"shares no column with .* \(final, eagle3, b0\)"),
    ({"layers": "final,eagle3", "eagle3_layer_ids": [0, 1, 2]}, r"column 'eagle3' would hold sources \[1, 2, 3\]"),
])
def test_options_that_do_not_apply_or_differ_from_the_source_are_refused(models, generated, tmp_path, change, message):
    cfg = ExtractConfig(model=models["target"], dataset=str(generated), output=str(tmp_path / "out"), layers="final,8")
    with pytest.raises(HsxError, match=message):
        extract(ExtractConfig(**{**cfg.to_dict(), **change}), progress=False)
    assert not (tmp_path / "out" / ".hsx-manifest.json").exists()


def test_the_source_itself_is_no_output_and_the_model_defaults_to_the_source_s(models, generated, tmp_path):
    with pytest.raises(HsxError, match="is the hsx output read as --dataset"):
        extract(ExtractConfig(model=models["target"], dataset=str(generated), output=str(generated)), progress=False)
    from hsx.data.stored import adopt_source

    cfg = adopt_source(ExtractConfig(dataset=str(generated), output=str(tmp_path / "out"), layers="final,8"))
    assert (cfg.model, cfg.mode, cfg.keep, cfg.max_new_tokens) == (models["target"], "generate", "all", 8)


def test_disagreement_flags_only_rows_beyond_the_limit():
    gen = torch.Generator().manual_seed(0)
    fresh = torch.randn(12, 64, generator=gen)
    tol = agreement_tolerance({"dtype": "bfloat16", "engine": {"compute_dtype": "float32"}}, "float32", "bfloat16")
    assert disagreement(fresh.to(torch.bfloat16), fresh, tol) is None
    shifted = torch.cat([fresh[:1], fresh[:-1]])
    bad, worst, rel = disagreement(shifted.to(torch.bfloat16), fresh, tol)
    assert bad == 11 and worst > 0 and rel > 10 * tol.rel
    broken = fresh.clone()
    broken[5, 3] = float("nan")
    assert disagreement(broken, fresh, tol)[:2] == (1, 5)
