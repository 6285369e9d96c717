"""``hsx verify --recompute`` on real shards from the transformers engine: clean shards pass (fp32 and
bf16 storage, fp32 and bf16 compute), and each injected fault is caught with its diagnosis.

Faults are injected by rewriting a clean output's rows and committing them through the shard
sink, so checksums and row counts stay valid: only a recompute can see them. States a faulty
engine would have stored instead (the next boundary, the pre-norm state, a rejected branch) come
from the test's own oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.align import LayerGroup
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from hsx.recompute import Reference, check_samples, recompute, tolerance_for
from hsx.compare.tolerance import UNIT_ROUNDOFF
from hsx.shards import quant
from hsx.shards.format import dtype_of
from oracle import oracle_sources
from shard_fixtures import rewrite

NUM_LAYERS = 8
LAYERS = "final,eagle3,0,3,8"  # eagle3 = boundaries [2, 4, 5]
ROWS = [
    {"id": "chat-a", "messages": [{"role": "user", "content": "How do tides work?"}]},
    {"id": "chat-b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
    {"id": "text-c", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "text-d", "text": "Bees"},
    {"id": "chat-e", "messages": [{"role": "user", "content": "What is bread made of, and why does it rise?"}]},
    {"id": "text-f", "text": "A longer line of plain text, so that the batch holds prompts of rather different lengths."},
]
# (stored dtype, engine compute dtype)
KINDS_OF_SHARDS = [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]
# the lossy dtypes: clean shards pass and shifted rows are caught
LOSSY_KINDS = [("int8", "float32"), ("float8_e4m3", "float32")]
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=len(tok), seed=3,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draft = make_layerskip_draft(target, num_layers=2)
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": target, "data": str(data),
            "root": root}


@pytest.fixture(scope="module")
def shards(models) -> dict:
    """Clean outputs of the transformers engine (chain speculation), one per (stored, compute) dtype pair."""
    out = {}
    for stored, compute in KINDS_OF_SHARDS + LOSSY_KINDS:
        d = models["root"] / f"clean-{stored}-{compute}"
        extract(ExtractConfig(model=models["target"], draft_model=models["draft"], dataset=models["data"], output=str(d),
                              id_field="id", dtype=stored, model_dtype=compute, layers=LAYERS, max_new_tokens=14,
                              batch_size=3, spec_num_steps=3, spec_topk=1, spec_num_draft_tokens=4), progress=False)
        out[(stored, compute)] = d
    return out


def run_cli(path: Path, *extra: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", str(path), "--recompute", "--json", *extra])
    return result.exit_code, json.loads(result.stdout)


def states_like(model, ids: torch.Tensor, source, dtype: torch.dtype) -> torch.Tensor:
    return oracle_sources(model, ids.long())[source].to(dtype)


def faulty_sample(report: dict, sample_id: str) -> dict:
    return next(s for s in report["samples"] if s["sample_id"] == sample_id)


def assert_only(report: dict, sample_ids: set[str]) -> None:
    bad = {s["sample_id"] for s in report["samples"] if s["findings"]}
    assert bad == sample_ids, bad


# --- the reference -----------------------------------------------------------------------------

def test_reference_equals_the_unbatched_oracle(models):
    ref = Reference.wrap(models["model"])
    ids = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (1, 7, 30, 12)]
    sources = [*range(NUM_LAYERS + 1), "final"]
    batched = ref.states(ids, sources)
    for i, t in enumerate(ids):
        want = oracle_sources(models["model"], t)
        for s in sources:
            got = batched[s][i, : t.numel()]
            assert (got - want[s]).abs().max() <= 1e-5 * want[s].abs().max(), (i, s)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_storage_rounding_stays_within_the_unit_roundoff(dtype):
    # the storage term of the tolerance: rounding a row to the stored dtype moves it by at most u, relative
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2000, 256, generator=gen, dtype=torch.float64) * torch.logspace(-3, 3, 2000, dtype=torch.float64)[:, None]
    rounded = rows.to(getattr(torch, dtype)).double()
    rel = (rounded - rows).norm(dim=1) / rows.norm(dim=1)
    assert rel.max() <= UNIT_ROUNDOFF[dtype]
    assert rel.max() >= UNIT_ROUNDOFF[dtype] / 4  # the bound is not loose by more than a small factor


@pytest.mark.parametrize("kind", ["int8", "float8_e4m3"])
def test_lossy_storage_stays_within_its_bound(kind):
    # the storage term of a lossy dtype: quantised and read back as bfloat16, a row moves by at most its bound,
    # on rows of every scale and on rows with one outlier per group of 64 (the worst case for int8's scales)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2000, 256, generator=gen) * torch.logspace(-3, 3, 2000)[:, None]
    rows[1000:, ::64] *= 200.0
    back = quant.dequantize(*quant.quantize(rows, kind), torch.bfloat16).double()
    rel = (back - rows.double()).norm(dim=1) / rows.double().norm(dim=1)
    assert rel.max() <= UNIT_ROUNDOFF[kind]
    assert rel.max() >= UNIT_ROUNDOFF[kind] / 8


# --- clean shards ------------------------------------------------------------------------------

@pytest.mark.parametrize("stored,compute", KINDS_OF_SHARDS + LOSSY_KINDS)
def test_clean_shards_pass(shards, stored, compute):
    code, out = run_cli(shards[(stored, compute)])
    assert code == 0, [f["message"] for s in out["recompute"]["samples"] for f in s["findings"]]
    r = out["recompute"]
    assert r["ok"] and len(r["samples"]) == len(ROWS) and all(s["verdict"] == "ok" for s in r["samples"])
    assert r["rows"] == sum(s["rows"] for s in r["samples"]) > 0
    assert r["row_checks"] == r["rows"] * (1 + 3 + 1 + 1 + 1)  # final, eagle3 (3 sources), b0, b3, b8
    assert all(s["worst_rel"] <= r["tolerance"]["rel"] for s in r["samples"])


def test_clean_text_report_prints_time_and_rate(shards):
    result = runner.invoke(app, ["verify", str(shards[("bfloat16", "float32")]), "--recompute", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "rows/s" in result.output and result.output.rstrip().endswith("recompute: OK")
    for sid in (r["id"] for r in ROWS):
        assert sid in result.output


def test_samples_are_chosen_reproducibly(shards):
    path = shards[("float32", "float32")]
    order = hsx.open(path).sample_ids
    picked = {}
    for seed in (5, 5, 6, 7):
        r = recompute(path, samples=3, seed=seed, progress=False)
        ids = [s.sample_id for s in r.samples]
        assert r.ok and len(set(ids)) == 3 and r.samples_total == len(ROWS)
        assert ids == sorted(ids, key=order.index)  # checked in storage order
        assert picked.setdefault(seed, ids) == ids  # the same seed picks the same samples
    assert len({tuple(v) for v in picked.values()}) > 1  # and the seed matters


# --- injected faults ---------------------------------------------------------------------------

@pytest.mark.parametrize("stored,compute", KINDS_OF_SHARDS + LOSSY_KINDS)
@pytest.mark.parametrize("shift", [1, -1])
def test_rows_shifted_by_one_position(models, shards, tmp_path, stored, compute, shift):
    dtype = dtype_of(stored)

    def edit(k, s, hidden):
        if s.sample_id != "chat-e":
            return
        for g in s._shard.metadata["layers"]:
            h = hidden[g["name"]]
            if shift == 1:  # row p holds the state of p+1; the last row the state nobody stored
                nxt = torch.cat([states_like(models["model"], s.input_ids, src, dtype)[-1:] for src in g["sources"]], -1)
                hidden[g["name"]] = torch.cat([h[1:], nxt])
            else:  # row p holds the state of p-1 (the first row is kept)
                hidden[g["name"]] = torch.cat([h[:1], h[:-1]])

    code, out = run_cli(rewrite(shards[(stored, compute)], tmp_path / "shifted", edit))
    assert code == 1
    assert_only(out["recompute"], {"chat-e"})
    s = faulty_sample(out["recompute"], "chat-e")
    assert s["verdict"] == "misaligned"
    moved = [f for f in s["findings"] if f["kind"] == "position"]
    others = [f for f in s["findings"] if f["kind"] != "position"]
    if stored in dict(LOSSY_KINDS):
        # a moved row within the lossy limit of a neighbour's state is told apart from its own position
        # but not placed: it reads as a mismatch (counted with the moved rows below)
        assert all(f["kind"] == "mismatch" for f in others), others
    else:
        assert not others, [f["message"] for f in others]
    assert {f["matched"] for f in moved} == {f"position p{shift:+d}"}, [f["message"] for f in s["findings"]]
    for column in ("final", "eagle3", "b3", "b8"):
        flagged = sum(f["rows"] for f in s["findings"] if f["column"] == column)
        moved_rows = (s["rows"] - 1) * (3 if column == "eagle3" else 1) - 1
        if stored in dict(LOSSY_KINDS):  # every moved row whose state is more than twice the limit from its own
            sample = hsx.open(shards[(stored, compute)]).select(["chat-e"])[0]
            apart = _rows_apart(models["model"], sample, column, shift, 2 * out["recompute"]["tolerance"]["rel"])
            assert 0 < apart and flagged >= apart - 1, (column, flagged, apart)
        elif compute == "float32":  # every moved row
            assert flagged >= moved_rows, column
        else:  # a bfloat16 engine: rows whose neighbour's state is within the limit cannot be told apart
            assert flagged >= 1, column


def _rows_apart(model, s, column: str, shift: int, limit: float) -> int:
    """Rows of sample ``s``'s column whose state differs from the one a shift by ``shift`` puts there by more than ``limit``."""
    group = next(g for g in s._shard.metadata["layers"] if g["name"] == column)
    n = s.num_rows + (1 if shift == 1 else 0)
    total = 0
    for src in group["sources"]:
        h = oracle_sources(model, s.input_ids.long())[src][:n].double()
        total += int(((h[1:] - h[:-1]).norm(dim=1) / h[:-1].norm(dim=1) > limit).sum())
    return total


@pytest.mark.parametrize("stored,compute", KINDS_OF_SHARDS)
def test_rows_of_two_samples_swapped(shards, tmp_path, stored, compute):
    # rows of two samples of one engine batch (text-d, chat-e) traded places, from the first token
    # where they differ (before it both hold the same states) to the end of the shorter one
    src = hsx.open(shards[(stored, compute)])
    a, b = src.select(["text-d"])[0], src.select(["chat-e"])[0]
    hi = min(a.num_rows, b.num_rows)
    lo = int((a.input_ids[:hi] != b.input_ids[:hi]).nonzero()[0, 0])
    assert hi - lo >= 3
    keep = {name: (a.hidden(name)[lo:hi].clone(), b.hidden(name)[lo:hi].clone()) for name in src.columns}

    def edit(k, s, hidden):
        for name, (ra, rb) in keep.items():
            if s.sample_id == "text-d":
                hidden[name][lo:hi] = rb
            elif s.sample_id == "chat-e":
                hidden[name][lo:hi] = ra

    code, out = run_cli(rewrite(shards[(stored, compute)], tmp_path / "swapped", edit))
    assert code == 1
    assert_only(out["recompute"], {"text-d", "chat-e"})
    for sid, other in (("text-d", "chat-e"), ("chat-e", "text-d")):
        s = faulty_sample(out["recompute"], sid)
        assert s["verdict"] == "misaligned"
        assert {f["matched"] for f in s["findings"]} == {f"sample {other!r}"}
        assert all(lo <= f["first"] and f["last"] < hi for f in s["findings"])
        assert {f["column"] for f in s["findings"]} == set(src.columns)


@pytest.mark.parametrize("stored,compute", KINDS_OF_SHARDS)
@pytest.mark.parametrize("padding", ["zero", "repeat"])
def test_last_rows_dropped_and_padded(shards, tmp_path, stored, compute, padding):
    dropped = 4

    def edit(k, s, hidden):
        if s.sample_id != "text-c":
            return
        for name, h in hidden.items():
            h[-dropped:] = 0 if padding == "zero" else h[-dropped - 1]

    code, out = run_cli(rewrite(shards[(stored, compute)], tmp_path / "padded", edit))
    assert code == 1
    assert_only(out["recompute"], {"text-c"})
    s = faulty_sample(out["recompute"], "text-c")
    assert s["verdict"] == "misaligned"
    assert {f["kind"] for f in s["findings"]} == {padding}, [f["message"] for f in s["findings"]]
    pad = (s["rows"] - dropped, s["rows"] - 1)
    deep = [f for f in s["findings"] if f["column"] != "b0"]
    if compute == "float32":
        assert {(f["first"], f["last"]) for f in deep} == {pad} and len(deep) == 6  # every other column source
    else:  # a copy of a state within the bfloat16 limit of the right one (the same token nearby) passes
        assert {(f["column"], f["source"]) for f in deep if f["first"] == pad[0]} == {
            ("final", "final"), ("eagle3", 2), ("eagle3", 4), ("eagle3", 5), ("b3", 3), ("b8", 8)}
    # at boundary 0 a pad row holding the embedding of its own (repeated) token is right, not flagged
    assert all(pad[0] <= f["first"] <= f["last"] <= pad[1] for f in s["findings"])


@pytest.mark.parametrize("stored,compute", KINDS_OF_SHARDS)
@pytest.mark.parametrize("column,index,source,wrong", [("b3", 0, 3, 4), ("b3", 0, 3, 2), ("eagle3", 1, 4, 5),
                                                       ("eagle3", 0, 2, 1), ("eagle3", 2, 5, 6)])
def test_column_from_the_neighbouring_boundary(models, shards, tmp_path, stored, compute, column, index, source, wrong):
    dtype = getattr(torch, stored)
    width = 64

    def edit(k, s, hidden):
        rows = hidden[column].shape[0]
        hidden[column][:, index * width:(index + 1) * width] = states_like(models["model"], s.input_ids, wrong, dtype)[:rows]

    code, out = run_cli(rewrite(shards[(stored, compute)], tmp_path / "layer", edit))
    assert code == 1
    r = out["recompute"]
    # the column-level test: averaged over every row, the column matches the other boundary
    col = next(c for c in r["sources"] if c["column"] == column and c["source"] == source)
    assert col["matches"] == f"boundary {wrong}"
    assert [(c["column"], c["source"]) for c in r["sources"] if c["matches"]] == [(column, source)]
    findings = [f for s in r["samples"] for f in s["findings"]]
    assert {(f["column"], f["source"], f["kind"], f["matched"]) for f in findings} <= {(column, source, "boundary", f"boundary {wrong}")}
    if compute == "float32":  # every row on its own, too
        assert all(s["verdict"] == "misaligned" for s in r["samples"])
        assert col["bad_rows"] == col["rows"] and col["matched"] == {f"boundary {wrong}": col["rows"]}
        assert f"column {column!r} source {source}: matches boundary {wrong} instead" in findings[0]["message"]


@pytest.mark.parametrize("stored,compute", KINDS_OF_SHARDS)
def test_pre_norm_boundary_stored_as_final(models, shards, tmp_path, stored, compute):
    dtype = getattr(torch, stored)

    def edit(k, s, hidden):
        hidden["final"][:] = states_like(models["model"], s.input_ids, NUM_LAYERS, dtype)[: hidden["final"].shape[0]]

    code, out = run_cli(rewrite(shards[(stored, compute)], tmp_path / "prenorm", edit))
    assert code == 1
    findings = [f for s in out["recompute"]["samples"] for f in s["findings"]]
    assert {(f["column"], f["kind"], f["matched"]) for f in findings} == {("final", "boundary", f"boundary {NUM_LAYERS} (before the final norm)")}
    assert {f["sample_id"] for f in findings} == {r["id"] for r in ROWS}


@pytest.mark.parametrize("stored,compute", KINDS_OF_SHARDS)
@pytest.mark.parametrize("depth", [1, 3])
def test_completion_rows_from_a_rejected_draft_branch(models, shards, tmp_path, stored, compute, depth):
    # A verify step's rejected nodes: the states after consuming draft tokens the target did not
    # emit, at the positions right after the root. Draft tokens absent from every sample keep b0
    # (the embedding) from matching some other position by coincidence.
    dtype = getattr(torch, stored)
    used = set(torch.cat([s.input_ids.long() for s in hsx.open(shards[(stored, compute)])]).tolist())
    unused = torch.tensor(sorted(set(range(6, 300)) - used)[:depth])  # not a special token (<|pad|> embeds to zero)

    def edit(k, s, hidden):
        if s.sample_id != "chat-b":
            return
        q = s.prompt_len + 2  # the root of the step; its own row was accepted
        ids = s.input_ids.long().clone()
        ids[q + 1:q + 1 + depth] = unused
        branch = oracle_sources(models["model"], ids)
        for g in s._shard.metadata["layers"]:
            rejected = torch.cat([branch[src] for src in g["sources"]], -1).to(dtype)
            hidden[g["name"]][q + 1:q + 1 + depth] = rejected[q + 1:q + 1 + depth]

    code, out = run_cli(rewrite(shards[(stored, compute)], tmp_path / "rejected", edit))
    assert code == 1
    assert_only(out["recompute"], {"chat-b"})
    s = faulty_sample(out["recompute"], "chat-b")
    q = hsx.open(shards[(stored, compute)]).select(["chat-b"])[0].prompt_len + 2
    assert s["verdict"] == "wrong values", [f["message"] for f in s["findings"] if f["kind"] != "mismatch"]
    assert {f["kind"] for f in s["findings"]} == {"mismatch"}
    assert {(f["first"], f["last"]) for f in s["findings"]} == {(q + 1, q + depth)}
    assert len(s["findings"]) == 7
    assert "rejected draft branch" in s["findings"][0]["message"]


# --- model selection ---------------------------------------------------------------------------

def test_a_copy_of_the_model_is_accepted_and_another_refused_unless_forced(models, shards, tmp_path):
    import shutil

    path = shards[("float32", "float32")]
    copy = tmp_path / "copy"
    shutil.copytree(models["target"], copy)
    assert run_cli(path, "--model", str(copy))[0] == 0
    other = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=models["model"].config.vocab_size,
                             seed=4, rope_theta=500.0)
    other.save_pretrained(tmp_path / "other")
    result = runner.invoke(app, ["verify", str(path), "--recompute", "--model", str(tmp_path / "other")])
    assert result.exit_code != 0 and "different config" in str(result.exception or result.output)
    with pytest.raises(HsxError, match="--force"):
        recompute(path, model=str(tmp_path / "other"), progress=False)
    forced = recompute(path, model=str(tmp_path / "other"), force=True, progress=False)
    assert not forced.ok and {s.verdict for s in forced.samples} == {"wrong values"}


def test_in_memory_samples_from_the_engine(models):
    from hsx.engine.hf.engine import HFEngine, SamplingSettings, SpecSettings

    groups = [LayerGroup("final", ("final",), 64), LayerGroup("b4", (4,), 64)]
    engine = HFEngine(models["model"], groups, draft_model=make_layerskip_draft(models["model"], 2),
                      spec=SpecSettings(3, 2, 5), store_dtype=torch.float32)
    prompts = [(f"r{i}", torch.arange(3 + 4 * i) % 50 + 10) for i in range(3)]
    samples = engine.generate(prompts, SamplingSettings(max_new_tokens=9))
    tol = tolerance_for("float32", "float32", "float32")
    assert all(r.verdict == "ok" for r in check_samples(models["model"], samples, groups, tol))
    samples[1].hidden["b4"] = torch.roll(samples[1].hidden["b4"], 1, dims=0)
    results = check_samples(models["model"], samples, groups, tol)
    assert [r.verdict for r in results] == ["ok", "misaligned", "ok"]
    assert {f.column for f in results[1].findings} == {"b4"}


@pytest.mark.parametrize("fault", ["shift", "swap", "layer", "prenorm"])
def test_misplaced_rows_are_caught_by_the_position_and_layer_tests_alone(models, shards, tmp_path, fault):
    # --rtol 1e9 lets every row pass its own error test: only "closer to another state than to its
    # own" can flag these rows, which is what keeps a loose bfloat16 limit sharp on misalignment
    path = shards[("bfloat16", "bfloat16")]
    src = hsx.open(path)
    a, b = src.select(["text-d"])[0], src.select(["chat-e"])[0]
    hi = min(a.num_rows, b.num_rows)
    lo = int((a.input_ids[:hi] != b.input_ids[:hi]).nonzero()[0, 0])
    swap = {"text-d": b.hidden("final")[lo:hi].clone(), "chat-e": a.hidden("final")[lo:hi].clone()}

    def edit(k, s, hidden):
        if fault == "shift" and s.sample_id == "chat-e":
            hidden["final"] = torch.cat([hidden["final"][:1], hidden["final"][:-1]])
        elif fault == "swap" and s.sample_id in swap:
            hidden["final"][lo:hi] = swap[s.sample_id]
        elif fault == "layer":
            hidden["b3"][:] = states_like(models["model"], s.input_ids, 4, torch.bfloat16)[: hidden["b3"].shape[0]]
        elif fault == "prenorm":
            hidden["b8"][:] = states_like(models["model"], s.input_ids, "final", torch.bfloat16)[: hidden["b8"].shape[0]]

    code, out = run_cli(rewrite(path, tmp_path / fault, edit), "--rtol", "1e9")
    assert code == 1
    findings = [f for s in out["recompute"]["samples"] for f in s["findings"]]
    want = {"shift": {("final", "position p-1")}, "swap": {("final", "sample 'chat-e'"), ("final", "sample 'text-d'")},
            "layer": {("b3", "boundary 4")}, "prenorm": {("b8", "final (after the final norm)")}}[fault]
    assert {(f["column"], f["matched"]) for f in findings} == want
    assert out["recompute"]["tolerance"]["rel"] == 1e9 and all(f["worst_rel"] <= 1e9 for f in findings)
