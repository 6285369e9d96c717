"""``hsx verify --recompute`` in chunks: a sample longer than the chunk is recomputed a chunk of tokens at a
time through a KV cache and its stored rows are read a chunk at a time.

Clean outputs of the transformers engine (prefill and generate mode, long samples written whole and
in small pieces) pass for chunk boundaries inside the prompt, at its end and inside the completion,
with the verdicts and errors of the one-forward recompute; rows shifted by one, one corrupted row in
a later chunk and a column holding the neighbouring boundary are caught as the one-forward
recompute catches them. Faults are injected as in tests/test_recompute.py (rewritten through the
shard sink, checksums valid); the wrong boundary's states come from the test's own oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.align import parse_layers, ModelShape
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.run.pipeline import extract
from hsx.recompute import AUTO_CHUNK, Reference, check_samples, chunk_for, recompute, tolerance_for
from hsx.recompute.chunked import HALO
from hsx.shards import format as fmt
from hsx.shards.reader import SampleColumns
from oracle import oracle_sources
from shard_fixtures import rewrite

NUM_LAYERS, HIDDEN = 8, 32
LAYERS = "final,eagle3,3,8"  # eagle3 = boundaries [2, 4, 5]
LONG = "long"
ROWS = [
    {"id": LONG, "text": "The river ran past the old mill and under the stone bridge, then on through the fields "
                         "where the cows stood in the shade of the elms, and out at last to the grey sea."},
    {"id": "short", "text": "Bees"},
    {"id": "chat", "messages": [{"role": "user", "content": "What is bread made of, and why does it rise?"}]},
]
MAX_NEW = 12
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Clean float32 outputs in both modes, each also rewritten in pieces of 3 rows."""
    root = tmp_path_factory.mktemp("recompute-chunk")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=HIDDEN, vocab_size=len(tok), seed=5,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = {"root": root, "model": model.eval()}
    for mode in ("prefill", "generate"):
        extract(ExtractConfig(model=str(root / "target"), dataset=str(data), output=str(root / mode), id_field="id",
                              mode=mode, max_new_tokens=MAX_NEW, layers=LAYERS, batch_size=2, dtype="float32",
                              model_dtype="float32"), progress=False)
        meta = hsx.open(root / mode).metadata
        out[(mode, False)] = root / mode
        out[(mode, True)] = rewrite(root / mode, root / f"{mode}-pieces", lambda k, s, h: None,
                                    piece_bytes=3 * max(fmt.row_bytes(g["width"], meta["dtype"]) for g in meta["layers"]))
    return out


def long_sample(path: Path):
    return hsx.open(path).select([LONG])[0]


def chunk_at(path: Path, where: str) -> int:
    """A chunk size whose boundaries fall inside the long sample's prompt, at its end, in its completion, or
    before its last token."""
    s = long_sample(path)
    prompt, n = int(s.prompt_len), len(s.input_ids)
    chunk = {"inside-prompt": prompt // 2 - 1, "prompt-end": prompt, "completion": prompt + MAX_NEW // 2,
             "last-token": n - 1, "tiny": 3}[where]
    edges = set(range(chunk, n, chunk))
    assert edges, (where, chunk, n)
    if where == "inside-prompt":
        assert any(0 < e < prompt for e in edges) and prompt not in edges
    elif where == "prompt-end":
        assert prompt in edges and prompt < n
    elif where == "completion":
        assert all(e > prompt for e in edges) and min(edges) < n
    elif where == "last-token":
        assert edges == {n - 1}
    return chunk


def sources_of(report) -> dict:
    return {(c.column, c.source): c for c in report.sources}


def assert_same_verdicts(chunked, whole) -> None:
    """Same verdicts, rows and findings as one forward per sample; every worst error within the limit and
    within fp32 rounding of the one-forward run's."""
    assert chunked.ok == whole.ok
    assert [(s.sample_id, s.rows, s.verdict) for s in chunked.samples] == \
           [(s.sample_id, s.rows, s.verdict) for s in whole.samples]
    assert [(f.sample_id, f.column, f.source, f.kind, f.first, f.last, f.matched) for f in chunked.findings] == \
           [(f.sample_id, f.column, f.source, f.kind, f.first, f.last, f.matched) for f in whole.findings]
    a, b = sources_of(chunked), sources_of(whole)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key].rows, a[key].bad_rows, a[key].matches) == (b[key].rows, b[key].bad_rows, b[key].matches), key


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
@pytest.mark.parametrize("mode,where", [("generate", w) for w in ("inside-prompt", "prompt-end", "completion",
                                                                    "last-token", "tiny")]
                         + [("prefill", w) for w in ("inside-prompt", "last-token", "tiny")])  # all prompt there
def test_clean_outputs_pass_in_chunks_as_in_one_forward(run, mode, where, pieces):
    path = run[(mode, pieces)]
    chunk = chunk_at(path, where)
    chunked = recompute(path, chunk=chunk, progress=False)
    whole = recompute(path, chunk="off", progress=False)
    longer = sum(len(s.input_ids) > chunk for s in hsx.open(path))
    assert chunked.chunk == chunk and chunked.chunked_samples == longer >= 1 and whole.chunked_samples == 0
    assert chunked.ok and whole.ok, [f.message for f in chunked.findings + whole.findings]
    assert chunked.rows == whole.rows == sum(s.num_rows for s in hsx.open(path)) > 0
    assert_same_verdicts(chunked, whole)
    limit = chunked.tolerance["rel"]
    for key, c in sources_of(chunked).items():
        w = sources_of(whole)[key]
        assert c.worst_rel <= limit and w.worst_rel <= limit
        # float32 rows of a float32 engine: both errors are rounding, well inside the limit of 2e-5
        assert abs(c.worst_rel - w.worst_rel) <= limit / 4, (key, c.worst_rel, w.worst_rel)


def test_short_samples_keep_one_forward(run):
    """The automatic chunk leaves samples of up to AUTO_CHUNK tokens in their batch's forward: the same report."""
    path = run[("generate", False)]
    assert max(len(s.input_ids) for s in hsx.open(path)) <= AUTO_CHUNK
    auto, whole = recompute(path, progress=False), recompute(path, chunk="off", progress=False)
    assert auto.chunk == "auto" and auto.chunked_samples == 0 and whole.chunk is None
    assert [(s.sample_id, s.rows, s.worst_rel, s.worst_cos) for s in auto.samples] == \
           [(s.sample_id, s.rows, s.worst_rel, s.worst_cos) for s in whole.samples]


def test_automatic_chunk_sizes():
    """auto: samples of up to 2048 tokens in their batch's forward, longer ones in chunks of 2048, fewer
    from 16K tokens on (a chunk's [chunk, tokens] attention mask within 2^25 entries), never below 256."""
    assert [chunk_for("auto", n) for n in (1, 2048, 2049, 8192, 16384, 32768, 131072, 1 << 20)] == \
           [None, None, 2048, 2048, 2048, 1024, 256, 256]
    assert [chunk_for(7, n) for n in (7, 8)] == [None, 7] and chunk_for(None, 10**6) is None


def test_chunks_read_and_recompute_a_chunk_at_a_time(run, monkeypatch):
    """The long sample's stored rows are read a chunk at a time and never whole, and every reference
    forward covers at most one chunk of tokens."""
    path, chunk = run[("generate", True)], 5
    reads, forwards = [], []
    call, forward = SampleColumns.__call__, Reference._forward

    def reading(self, name, rows=None):
        reads.append((self._sample.sample_id, rows))
        return call(self, name, rows)

    def forwarding(self, sources, **inputs):
        forwards.append(inputs["input_ids"].shape)
        return forward(self, sources, **inputs)

    monkeypatch.setattr(SampleColumns, "__call__", reading)
    monkeypatch.setattr(Reference, "_forward", forwarding)
    report = recompute(path, chunk=chunk, progress=False, batch_size=8)
    assert report.ok and report.chunked_samples >= 2
    long_reads = [rows for sid, rows in reads if sid == LONG]
    assert long_reads and all(r is not None and r.stop - r.start <= chunk for r in long_reads)
    n = len(long_sample(path).input_ids)
    groups = len(hsx.open(path).columns)
    assert len(long_reads) == groups * -(-n // chunk)  # each column once per chunk
    assert forwards and max(shape[1] for shape in forwards) <= chunk


# ---- faults ---------------------------------------------------------------------------------------------


def _shift_from(first: int):
    def edit(k, s, hidden):
        if s.sample_id == LONG:  # rows first.. hold the state of the position after theirs; the last is repeated
            for name in hidden:
                hidden[name] = torch.cat([hidden[name][:first], hidden[name][first + 1:], hidden[name][-1:]])
    return edit


def _corrupt_row(row: int):
    def edit(k, s, hidden):
        if s.sample_id == LONG:
            g = torch.Generator().manual_seed(row)
            h = hidden["final"]
            h[row] = torch.randn(h.shape[1], generator=g) * h[row].norm() / h.shape[1] ** 0.5
    return edit


def _wrong_boundary(model):
    def edit(k, s, hidden):  # column b3 holds boundary 4 (the block after it), every sample
        hidden["b3"][:] = oracle_sources(model, s.input_ids.long())[4][: hidden["b3"].shape[0]]
    return edit


@pytest.mark.parametrize("mode", ["prefill", "generate"])
@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_rows_shifted_by_one_are_caught_across_chunks(run, tmp_path, mode, pieces):
    chunk = 6
    src = run[(mode, False)]
    n_rows = long_sample(src).num_rows
    first = 2 * chunk + 3  # inside the third chunk; the shift runs on through every later chunk
    bad = rewrite(src, tmp_path / "shifted", _shift_from(first), **_pieces(src, pieces))
    chunked, whole = recompute(bad, chunk=chunk, progress=False), recompute(bad, chunk="off", progress=False)
    assert not chunked.ok and chunked.chunked_samples >= 1
    assert {s.sample_id for s in chunked.samples if s.findings} == {LONG}
    assert_same_verdicts(chunked, whole)
    shifted = [f for f in chunked.findings if f.kind == "position"]
    assert {f.matched for f in shifted} == {"position p+1"}
    # one finding per column source, from the first shifted row across the chunks' edges
    assert {(f.first, f.last) for f in shifted} == {(first, n_rows - 2)}
    assert len(shifted) == len(sources_of(chunked))


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_one_corrupted_row_in_a_later_chunk_is_caught(run, tmp_path, pieces):
    chunk = 7
    src = run[("generate", False)]
    row = 3 * chunk + chunk // 2  # the middle of the fourth chunk
    assert row < long_sample(src).num_rows - chunk
    bad = rewrite(src, tmp_path / "corrupt", _corrupt_row(row), **_pieces(src, pieces))
    chunked, whole = recompute(bad, chunk=chunk, progress=False), recompute(bad, chunk="off", progress=False)
    assert not chunked.ok
    assert [(f.sample_id, f.column, f.source, f.kind, f.first, f.last) for f in chunked.findings] == \
           [(LONG, "final", "final", "mismatch", row, row)]
    assert_same_verdicts(chunked, whole)
    assert chunked.findings[0].worst_rel > 100 * chunked.tolerance["rel"]


@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_rows_of_the_neighbouring_boundary_are_caught(run, tmp_path, mode):
    chunk = 5
    src = run[(mode, False)]
    bad = rewrite(src, tmp_path / "layer", _wrong_boundary(run["model"]), **_pieces(src, True))
    chunked, whole = recompute(bad, chunk=chunk, progress=False), recompute(bad, chunk="off", progress=False)
    assert not chunked.ok and chunked.chunked_samples >= 1
    col = sources_of(chunked)[("b3", 3)]
    assert col.matches == "boundary 4" and col.bad_rows == col.rows
    assert {(f.column, f.kind, f.matched) for f in chunked.findings} == {("b3", "boundary", "boundary 4")}
    assert_same_verdicts(chunked, whole)


def _pieces(src: Path, pieces: bool) -> dict:
    if not pieces:
        return {}
    meta = hsx.open(src).metadata
    return {"piece_bytes": 3 * max(fmt.row_bytes(g["width"], meta["dtype"]) for g in meta["layers"])}


# ---- the command line and samples in memory ---------------------------------------------------------------


def test_cli_recompute_chunk(run, tmp_path):
    path = run[("generate", True)]
    result = runner.invoke(app, ["verify", str(path), "--recompute", "--json", "--recompute-chunk", "6"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["recompute"]
    assert report["ok"] and report["chunk"] == 6 and report["chunked_samples"] >= 2
    result = runner.invoke(app, ["verify", str(path), "--recompute", "--json", "--recompute-chunk", "off"])
    assert result.exit_code == 0 and json.loads(result.stdout)["recompute"]["chunk"] is None
    bad = rewrite(run[("generate", False)], tmp_path / "shifted", _shift_from(20))
    result = runner.invoke(app, ["verify", str(bad), "--recompute", "--json", "--recompute-chunk", "6"])
    assert result.exit_code == 1 and not json.loads(result.stdout)["recompute"]["ok"]
    for value in ("0", "-3", "big"):
        result = runner.invoke(app, ["verify", str(path), "--recompute", "--recompute-chunk", value])
        assert result.exit_code != 0 and "auto, off or a number of tokens >= 1" in str(result.exception), value
    help_text = runner.invoke(app, ["verify", "--help"], env={"NO_COLOR": "1", "COLUMNS": "200"}).output
    assert "--recompute-chunk" in help_text and f"auto (N = {AUTO_CHUNK}," in help_text


def test_in_memory_engine_samples_in_chunks(run):
    from hsx.engine.hf.engine import HFEngine

    model = run["model"]
    groups = parse_layers(LAYERS, ModelShape.from_config(model.config))
    engine = HFEngine(model, groups, store_dtype=torch.float32)
    prompts = [(f"r{i}", torch.arange(4 + 11 * i) % 50 + 10) for i in range(3)]
    samples = engine.prefill(prompts)
    tol = tolerance_for("float32", "float32", "float32")
    assert all(r.verdict == "ok" for r in check_samples(model, samples, groups, tol, "prefill", chunk=4))
    samples[2].hidden["final"] = torch.cat([samples[2].hidden["final"][:1], samples[2].hidden["final"][:-1]])
    results = check_samples(model, samples, groups, tol, "prefill", chunk=4)
    assert [r.verdict for r in results] == ["ok", "ok", "misaligned"]
    assert {(f.column, f.matched) for f in results[2].findings} == {("final", "position p-1")}
    assert 4 < HALO  # a window reaches past its chunk's edges
