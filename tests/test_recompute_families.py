"""``hsx verify --recompute`` on the 2026 families: clean outputs pass, and three faults are caught.

Each family's tiny model (tests/families.py, with the demo tokenizer's vocabulary) runs ``hsx extract``
with chain drafts from a perturbed copy (layer groups ``final``, ``eagle3``, boundary 0); the recompute
loads the saved model on its own (sdpa, or eager where the family has no sdpa path) and compares every
sampled row with its teacher-forced forward. The faults are written through the shard sink, so only a
recompute can see them: one sample's rows moved by one position, two samples' rows traded, and the
boundary-0 column holding boundary 1.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from typer.testing import CliRunner

import hsx
from families import DRAFT_SCALE, RECURRENT, build
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import perturbed_copy
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.run.pipeline import extract
from oracle import oracle_sources
from shard_fixtures import rewrite

FAMILIES_2026 = (*RECURRENT, "deepseek_v3", "glm4_moe", "minimax_m2", "mimo_v2_flash", "llama4_text", "gemma4",
                 "deepseek_v4")
ROWS = [
    {"id": "tides", "messages": [{"role": "user", "content": "How do tides work, and why are there two a day?"}]},
    {"id": "river", "text": "The river ran past the old mill and under the stone bridge to the sea."},
    {"id": "bees", "text": "Bees"},
]
runner = CliRunner()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families_2026")


@functools.cache
def _tokenizer():
    return build_demo_tokenizer()


def _clean(root, family: str):
    """The family's saved model and a clean ``hsx extract`` output of it (made once per family)."""
    out = root / family / "clean"
    if out.exists():
        return build_target(family), out
    tok = _tokenizer()
    target = build_target(family)
    for name, model in (("target", target), ("draft", perturbed_copy(target, DRAFT_SCALE.get(family, 0.05), 1))):
        model.save_pretrained(root / family / name)
        tok.save_pretrained(root / family / name)
    data = root / family / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # DeepSeek-V4: every boundary its 4 streams, final one stream (tests/test_families.py)
    run = dict(draft_model=str(root / family / "draft"), layers="final,eagle3,0", max_new_tokens=10,
               spec_num_steps=3, spec_topk=1, spec_num_draft_tokens=4)
    extract(ExtractConfig(model=str(root / family / "target"), dataset=str(data), output=str(out), id_field="id",
                          dtype="float32", model_dtype="float32", batch_size=3, **run), progress=False)
    return target, out


@functools.cache
def build_target(family: str):
    tok = _tokenizer()
    return build(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                 bos_token_id=tok.bos_token_id)


def _recompute(path) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", str(path), "--recompute", "--json"])
    return result.exit_code, json.loads(result.stdout)


def _findings(report: dict) -> dict:
    return {s["sample_id"]: {f["matched"] for f in s["findings"]} for s in report["samples"] if s["findings"]}


@pytest.mark.parametrize("family", FAMILIES_2026)
def test_clean_output_passes_and_three_faults_are_caught(family, root, tmp_path):
    target, clean = _clean(root, family)
    code, out = _recompute(clean)
    assert code == 0, out["recompute"]["samples"]
    assert {s["verdict"] for s in out["recompute"]["samples"]} == {"ok"}
    assert hsx.open(clean).metadata["model"]["model_type"] == target.config.model_type

    def shifted(k, s, hidden):  # row p holds the state of p-1 (the first row is kept)
        if s.sample_id == "tides":
            for name, h in hidden.items():
                hidden[name] = torch.cat([h[:1], h[:-1]])

    code, out = _recompute(rewrite(clean, tmp_path / "shifted", shifted))
    assert code == 1 and _findings(out["recompute"]) == {"tides": {"position p-1"}}, _findings(out["recompute"])

    src = hsx.open(clean)
    a, b = src.select(["tides"])[0], src.select(["river"])[0]
    hi = min(a.num_rows, b.num_rows)
    lo = int((a.input_ids[:hi] != b.input_ids[:hi]).nonzero()[0, 0])
    rows = {name: (a.hidden(name)[lo:hi].clone(), b.hidden(name)[lo:hi].clone()) for name in src.columns}

    def traded(k, s, hidden):
        for name, (ra, rb) in rows.items():
            if s.sample_id in ("tides", "river"):
                hidden[name][lo:hi] = rb if s.sample_id == "tides" else ra

    code, out = _recompute(rewrite(clean, tmp_path / "traded", traded))
    assert code == 1
    assert _findings(out["recompute"]) == {"tides": {"sample 'river'"}, "river": {"sample 'tides'"}}

    def boundary_one(k, s, hidden):  # the boundary-0 column holds what the first block returns
        with torch.no_grad():
            hidden["b0"][:] = oracle_sources(target, s.input_ids.long())[1][: hidden["b0"].shape[0]]

    code, out = _recompute(rewrite(clean, tmp_path / "boundary", boundary_one))
    assert code == 1
    assert set(_findings(out["recompute"])) == {r["id"] for r in ROWS}
    assert set().union(*_findings(out["recompute"]).values()) == {"boundary 1"}


def test_deepseek_v4_recompute_in_chunks_through_its_own_cache(root):
    # --recompute-chunk runs the reference through transformers' own cache, one sample at a time: on DeepSeek-V4
    # its compressed-attention cache layers, batch-wide, which one sample fills alone
    _, clean = _clean(root, "deepseek_v4")
    result = runner.invoke(app, ["verify", str(clean), "--recompute", "--json", "--recompute-chunk", "8"])
    assert result.exit_code == 0, result.stdout
    samples = json.loads(result.stdout)["recompute"]["samples"]
    assert {s["verdict"] for s in samples} == {"ok"} and sum(s["rows"] for s in samples) > 50
