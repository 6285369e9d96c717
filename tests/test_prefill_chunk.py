"""``--prefill-chunk``: prompts prefilled N tokens at a time through the KV cache, against the one-forward prefill.

Every stored column of a chunked ``hsx extract`` equals the one-forward run's, sample by sample, in
prefill and generate mode, batches of 1 and 3 padded prompts, plain and speculative decoding, for
chunks of one token, of a few tokens (a chunk boundary inside every longer prompt), as long as the
longest prompt and longer than it; greedy tokens are the same. ``hsx verify --recompute`` passes on
chunked outputs and catches rows moved by one position in one of them.

Tolerance (fp32 compute and storage): ``|chunked - one forward| <= 1e-4 + 1e-5 * max |one forward|``
per column, the bound the oracle tests hold every batch shape to (tests/test_families.py). A chunk
changes the shapes of the attention and matmul reductions, so their summation order, which moves
fp32 results by a few units in the last place compounded over the blocks (about 1e-6 here); a row
from the wrong position, a chunk that misses its predecessors' keys or a wrong mask moves it by O(1).

The engine also no longer asks the model for every layer's states: a real forward shows that
``output_hidden_states`` is not requested, that the model returns none, that the outputs of the
blocks a run does not store are freed before the final norm runs, and that lm_head sees only the
positions whose logits are read.
"""

from __future__ import annotations

import functools
import json
import weakref

import pytest
import torch
from typer.testing import CliRunner

import hsx
from families import FAMILIES, VOCAB, cached, rel_tol
from hsx.align import ModelShape, parse_layers
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama, perturbed_copy
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from oracle import logits_of, oracle_rows, oracle_sources
from shard_fixtures import rewrite

NUM_LAYERS = 8
LAYERS = "final,eagle3,0,8"  # eagle3 = boundaries [2, 4, 5]; boundary 0 and L = 8 (pre-norm)
TOL, REL_TOL = 1e-4, 1e-5
ROWS = [
    {"id": "tides", "messages": [{"role": "user", "content": "How do tides work, and why are there two a day?"},
                                 {"role": "assistant", "content": "The Moon pulls on the oceans."}]},
    {"id": "bees", "text": "Bees"},
    {"id": "river", "text": "The river ran past the old mill and under the stone bridge to the sea."},
    {"id": "bread", "messages": [{"role": "system", "content": "Answer in one line."},
                                 {"role": "user", "content": "What is bread made of?"}]},
    {"id": "long", "text": "A longer line of plain text, so that a batch holds prompts of rather different lengths, "
                           "which is where padding and chunk boundaries go wrong if they do."},
    {"id": "kettle", "text": "The kettle clicked off."},
]
# chunk sizes by what they do to the prompts; "prompt" and "longer" are resolved from the one-forward run
CHUNKS = ("one token", "inside", "prompt", "longer")
INSIDE = 4  # a chunk boundary inside every prompt longer than 4 tokens, at a different place in each
CASES = ([("prefill", "plain", b, c) for b in (1, 3) for c in CHUNKS]
         + [("generate", s, b, c) for s in ("plain", "chain") for b in (1, 3) for c in CHUNKS])
runner = CliRunner()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: thread hand-offs cost more than the matmuls, badly so on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("chunk_models")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=len(tok), seed=1,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draft = perturbed_copy(target, scale=0.3, seed=1)  # accepts some drafts and rejects others
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": target, "data": str(data),
            "root": root}


@pytest.fixture(scope="module")
def run(models):
    """``run(mode, spec, batch, chunk)``: the output of that extract (made once per module)."""

    @functools.cache
    def made(mode: str, spec: str, batch: int, chunk: int | None):
        name = f"{mode}-{spec}-b{batch}-c{chunk}"
        decoding = {} if spec == "plain" else dict(draft_model=models["draft"], spec_num_steps=3, spec_topk=1,
                                                   spec_num_draft_tokens=4)
        out = models["root"] / name
        extract(ExtractConfig(model=models["target"], dataset=models["data"], output=str(out), id_field="id",
                              mode=mode, layers=LAYERS, dtype="float32", model_dtype="float32", max_new_tokens=8,
                              batch_size=batch, prefill_chunk=chunk, **decoding), progress=False)
        return out

    return made


def chunk_size(name: str, one_forward) -> int:
    """Tokens per chunk for ``name``, from the one-forward output's longest prompt."""
    longest = max(s.prompt_len for s in one_forward)  # prefill mode: the whole sequence
    return {"one token": 1, "inside": INSIDE, "prompt": longest, "longer": longest + 9}[name]


def close(got: torch.Tensor, want: torch.Tensor, rel: float = REL_TOL) -> tuple[bool, float]:
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    return diff <= TOL + rel * (float(want.abs().max()) if want.numel() else 0.0), diff


# ---- the grid --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,spec,batch,chunk", CASES)
def test_chunked_rows_equal_the_one_forward_run(run, mode, spec, batch, chunk):
    one = hsx.open(run(mode, spec, batch, None))
    size = chunk_size(chunk, one)
    chunked = hsx.open(run(mode, spec, batch, size))
    assert chunked.sample_ids == one.sample_ids == [r["id"] for r in ROWS]
    if chunk == "inside":
        assert sum(s.prompt_len > INSIDE for s in one) >= 4  # most prompts are cut, each at its own place
    for a, b in zip(chunked, one):
        assert torch.equal(a.input_ids, b.input_ids), a.sample_id  # greedy tokens: the same
        assert (a.prompt_len, a.finish_reason, a.num_rows) == (b.prompt_len, b.finish_reason, b.num_rows)
        for name in one.columns:
            ok, diff = close(a.hidden(name), b.hidden(name))
            assert ok, f"{a.sample_id} {name}: max |diff| {diff:.3g}"
        if spec != "plain":
            assert int(a.accept_lens.sum()) >= len(a.input_ids) - a.prompt_len - 1
    if spec != "plain":
        accepts = torch.cat([s.accept_lens for s in one]).long()
        assert bool((accepts == 1).any()) and bool((accepts > 1).any()), accepts  # drafts accepted and rejected


def test_a_chunked_run_checks_against_the_oracle(run, models):
    # the chunked output on its own, against the independent teacher-forced forward (not only the one-forward run)
    for mode, spec in (("prefill", "plain"), ("generate", "chain")):
        ds = hsx.open(run(mode, spec, 3, INSIDE))
        groups = parse_layers(LAYERS, ModelShape.from_config(models["model"].config))
        for s in ds:
            ids = s.input_ids.long()
            rows = len(ids) if mode == "prefill" else len(ids) - 1
            ref = oracle_rows(models["model"], ids, groups)
            for g in groups:
                ok, diff = close(s.hidden(g.name), ref[g.name][:rows])
                assert ok, (mode, s.sample_id, g.name, diff)
            if mode == "generate":
                with torch.no_grad():
                    greedy = logits_of(models["model"], oracle_sources(models["model"], ids)["final"]).argmax(-1)
                assert torch.equal(ids[s.prompt_len:], greedy[s.prompt_len - 1: len(ids) - 1]), s.sample_id


# ---- recompute -------------------------------------------------------------------------------

def recompute_cli(path) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", str(path), "--recompute", "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("mode,spec", [("prefill", "plain"), ("generate", "chain")])
def test_recompute_passes_on_chunked_output(run, mode, spec):
    code, out = recompute_cli(run(mode, spec, 3, INSIDE))
    r = out["recompute"]
    assert code == 0, [f["message"] for s in r["samples"] for f in s["findings"]]
    assert r["ok"] and len(r["samples"]) == len(ROWS) and r["rows"] > 0


@pytest.mark.parametrize("shift", [1, -1])
def test_recompute_catches_rows_moved_by_one_in_a_chunked_output(run, tmp_path, shift):
    def edit(k, s, hidden):
        if s.sample_id != "long":
            return
        for name, h in hidden.items():  # row p holds the state of p+1 (the last row repeated) or of p-1
            hidden[name] = torch.cat([h[1:], h[-1:]]) if shift == 1 else torch.cat([h[:1], h[:-1]])

    code, out = recompute_cli(rewrite(run("generate", "chain", 3, INSIDE), tmp_path / "moved", edit))
    assert code == 1
    r = out["recompute"]
    assert {s["sample_id"] for s in r["samples"] if s["findings"]} == {"long"}
    moved = next(s for s in r["samples"] if s["sample_id"] == "long")
    assert moved["verdict"] == "misaligned"
    assert f"position p{shift:+d}" in {f.get("matched") for f in moved["findings"]}, moved["findings"]


# ---- what the engine asks of the model -------------------------------------------------------

def prompts(lengths, seed=0, vocab=VOCAB):
    gen = torch.Generator().manual_seed(seed)
    return [(f"r{i}", torch.randint(0, vocab, (n,), generator=gen)) for i, n in enumerate(lengths)]


class Watch:
    """Real forwards of ``model`` observed: the keywords it was called with, what it returned, the width of
    every forward, the positions lm_head saw, and which block outputs were still alive when the final norm ran."""

    def __init__(self, model):
        self.model, self.calls, self.widths, self.head_positions, self.alive_at_norm = model, [], [], [], []
        self.outputs: dict[int, weakref.ref] = {}
        blocks = model.model.layers
        self.handles = [model.register_forward_hook(self._model, with_kwargs=True),
                        model.lm_head.register_forward_pre_hook(self._head),
                        model.model.norm.register_forward_pre_hook(self._norm)]
        self.handles += [b.register_forward_hook(self._block(i)) for i, b in enumerate(blocks)]

    def _model(self, module, args, kwargs, output):
        self.calls.append((kwargs.get("output_hidden_states"), output.hidden_states))
        self.widths.append(kwargs["input_ids"].shape[1])

    def _head(self, module, args):
        self.head_positions.append(args[0].shape[1])  # [B, positions, H]

    def _block(self, i):
        def hook(module, args, output):
            self.outputs[i] = weakref.ref(output[0] if isinstance(output, tuple) else output)
        return hook

    def _norm(self, module, args):
        self.alive_at_norm.append({i for i, ref in self.outputs.items() if ref() is not None})

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("chunk", [None, 3])
def test_prefill_asks_for_no_hidden_states_and_frees_unstored_blocks(chunk):
    model = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=64, vocab_size=VOCAB, seed=2)
    groups = parse_layers("final,b3", ModelShape.from_config(model.config))  # boundary 3 = block 2's output
    eng = HFEngine(model, groups, store_dtype=torch.float32, prefill_chunk=chunk)
    watch = Watch(model)  # after the engine's one layout check, which does ask for them
    try:
        samples = eng.prefill(prompts((11, 4, 7)))
        eng.generate(prompts((6, 9), seed=1), SamplingSettings(max_new_tokens=4))
    finally:
        watch.close()
    assert watch.calls and all(flag is False and states is None for flag, states in watch.calls), watch.calls
    # when the final norm runs, block 2's output (stored) and the last block's (its input) are alive; the six
    # other blocks' outputs are gone (a forward asking for output_hidden_states would hold all eight)
    assert watch.alive_at_norm and all(alive <= {2, NUM_LAYERS - 1} for alive in watch.alive_at_norm), watch.alive_at_norm
    assert all(2 in alive for alive in watch.alive_at_norm)
    if chunk is not None:
        assert max(watch.widths) == chunk and watch.widths[:4] == [3, 3, 3, 2]  # the 11-token batch: four forwards
    for sample, (_, ids) in zip(samples, prompts((11, 4, 7))):
        ref = oracle_rows(model, ids, groups)
        assert all(close(sample.hidden[g.name], ref[g.name])[0] for g in groups)


@pytest.mark.parametrize("chunk", [None, 4])
def test_lm_head_sees_only_the_positions_whose_logits_are_read(chunk):
    model = build_tiny_llama(num_layers=4, hidden_size=64, vocab_size=VOCAB, seed=2)
    groups = parse_layers("final", ModelShape.from_config(model.config))
    spec = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
    draft = perturbed_copy(model, 0.3, seed=1)
    eng = HFEngine(model, groups, draft_model=draft, spec=spec, store_dtype=torch.float32, prefill_chunk=chunk)
    watch = Watch(model)
    try:
        eng.prefill(prompts((17, 5, 12)))
        prefill_mode = list(watch.head_positions)
        eng.generate(prompts((15, 3, 9), seed=1), SamplingSettings(max_new_tokens=6))
    finally:
        watch.close()
    assert prefill_mode and set(prefill_mode) == {0}  # prefill mode reads no logits: lm_head gets no position
    generate_mode = watch.head_positions[len(prefill_mode):]
    # a prompt forward: the distinct last positions of the rows ending in it (at most 3); a verify step: its 4 nodes
    assert generate_mode and max(generate_mode) <= max(3, spec.num_draft_tokens) < 15, generate_mode


# ---- drafts that read the prefill ------------------------------------------------------------

@pytest.fixture(scope="module")
def head_models(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from hsx.demo.spec_models import build_spec_models
    from hsx.engine.families import load_causal_lm

    root = tmp_path_factory.mktemp("chunk_heads")
    models = build_spec_models(root / "spec")
    target = load_causal_lm(str(models.target), torch.float32, what="target model").eval()
    # attention that changes the head's output (the built head's o_proj is zero): its drafts then read the
    # cache its prefill wrote, each slot pairing a prompt token with the target's aux state before it
    weights = load_file(str(models.eagle3 / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    weights["midlayer.self_attn.o_proj.weight"] = torch.randn(weights["midlayer.self_attn.o_proj.weight"].shape,
                                                              generator=gen) * 0.3
    save_file(weights, str(models.eagle3 / "model.safetensors"))
    return models, target


def regime_prompts(spec_models, lengths, seed=4):
    """Prompts whose last token sets the head's regime (hsx.demo.spec_models): follow, mixed, miss."""
    gen = torch.Generator().manual_seed(seed)
    everything = torch.tensor(sum(spec_models.classes.values(), []))
    out = []
    for i, (regime, n) in enumerate(zip(("mixed", "follow", "miss"), lengths)):
        ids = everything[torch.randint(len(everything), (n,), generator=gen)]
        cls = torch.tensor(spec_models.classes[regime])
        ids[-1] = cls[torch.randint(len(cls), (1,), generator=gen)]
        out.append((f"{regime}{i}", ids))
    return out


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("draft", ["eagle3 head", "draft model"])
def test_draft_prefill_in_chunks_drafts_the_same(models, head_models, draft, chunk):
    # the drafts (hence the accept lengths) depend on the draft's prefill of the prompt: a chunk that paired a
    # token with the wrong aux state, or whose keys a later chunk could not see, drafts other tokens
    from hsx.demo.spec_models import EAGLE3_IDS
    from hsx.heads.load import load_eagle3_head

    lengths = (13, 2, 9)
    if draft == "eagle3 head":
        spec_models, target = head_models
        groups = parse_layers("final,eagle3", ModelShape.from_config(target.config), eagle3_ids=EAGLE3_IDS)
        reqs = regime_prompts(spec_models, lengths)
        make = functools.partial(load_eagle3_head, spec_models.eagle3, target, torch.float32)
    else:
        target = models["model"]
        groups = parse_layers(LAYERS, ModelShape.from_config(target.config))
        reqs = prompts(lengths, seed=4, vocab=int(target.config.vocab_size))
        make = functools.partial(perturbed_copy, target, 0.3, seed=1)
    sampling = SamplingSettings(max_new_tokens=12)
    spec = SpecSettings(num_steps=3, topk=2, num_draft_tokens=6)
    for padding in ("right", "left"):
        one, chunked = (HFEngine(target, groups, draft_model=make(), spec=spec, store_dtype=torch.float32,
                                 padding_side=padding, prefill_chunk=c).generate(reqs, sampling) for c in (None, chunk))
        for a, b in zip(chunked, one):
            assert torch.equal(a.input_ids, b.input_ids)
            assert a.accept_lens.tolist() == b.accept_lens.tolist(), (padding, a.accept_lens, b.accept_lens)
            assert all(close(a.hidden[n], b.hidden[n])[0] for n in b.hidden)
        accepts = torch.cat([s.accept_lens for s in one]).long()
        assert bool((accepts == 1).any()) and bool((accepts > 1).any()), accepts


# ---- every family --------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_of_every_family_equals_the_oracle(family):
    # windows of 5 tokens (tests/families.py): chunks of 3 see keys across chunk boundaries, and drop them
    model = cached(family)
    groups = parse_layers("final,eagle3,0,2,4", ModelShape.from_config(model.config), eagle3_ids=[0, 2, 3])
    eng = HFEngine(model, groups, store_dtype=torch.float32, prefill_chunk=3)
    reqs = prompts((9, 1, 4, 23), seed=3)
    for sample, (rid, ids) in zip(eng.prefill(reqs), reqs):
        ref = oracle_rows(model, ids, groups)
        for g in groups:
            ok, diff = close(sample.hidden[g.name], ref[g.name], rel_tol(family, REL_TOL))
            assert ok, (family, rid, g.name, diff)
    for sample in eng.generate(prompts((14, 6), seed=5), SamplingSettings(max_new_tokens=6)):
        ids, n = sample.input_ids, sample.input_ids.numel()
        ref = oracle_rows(model, ids, groups)
        assert all(close(sample.hidden[g.name], ref[g.name][: n - 1], rel_tol(family, REL_TOL))[0] for g in groups), family
        with torch.no_grad():
            greedy = logits_of(model, oracle_sources(model, ids)["final"]).argmax(-1)
        assert torch.equal(ids[sample.prompt_len:], greedy[sample.prompt_len - 1: n - 1]), family


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_nonsense_chunk_sizes_are_refused_by_name(value):
    with pytest.raises(HsxError, match=r"--prefill-chunk must be a number of prompt tokens >= 1, got"):
        ExtractConfig(model="m", dataset="d", output="o", prefill_chunk=value).validate()
    model = build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=64)
    with pytest.raises(HsxError, match=r"prefill_chunk must be a number of tokens >= 1"):
        HFEngine(model, parse_layers("final", ModelShape.from_config(model.config)), prefill_chunk=value)


def test_sglang_engine_refuses_prefill_chunk():
    from hsx.engine.registry import check_engine

    with pytest.raises(HsxError, match=r"--prefill-chunk 512 applies to the transformers engine.*chunked_prefill_size"):
        check_engine(ExtractConfig(model="m", dataset="d", output="o", engine="sglang", prefill_chunk=512).validate())


def test_cli_refuses_a_zero_chunk_before_loading_anything(models, tmp_path):
    result = runner.invoke(app, ["extract", "--model", models["target"], "--dataset", models["data"], "--output",
                                 str(tmp_path / "out"), "--prefill-chunk", "0", "--quiet"])
    assert isinstance(result.exception, HsxError), result.output
    assert "--prefill-chunk must be a number of prompt tokens >= 1, got 0" in str(result.exception)
    assert not (tmp_path / "out").exists()


def test_the_option_reaches_the_engine_and_stays_out_of_the_config_hash(models):
    from hsx.engine.registry import build_engine

    cfg = ExtractConfig(model=models["target"], dataset=models["data"], output="o", mode="prefill", prefill_chunk=5)
    assert build_engine(cfg).engine.prefill_chunk == 5
    # like --batch-size it changes a row's last bits, not which rows exist: a resume may change it
    assert cfg.fingerprint() == ExtractConfig(**{**cfg.to_dict(), "prefill_chunk": None}).fingerprint()
