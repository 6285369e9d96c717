"""Every supported family in the transformers engine against the oracle (an unbatched, teacher-forced
forward of the same model, with the model's own masks).

The families differ where misalignment hides: sliding-window layers (Mistral, Phi-3, all layers;
Gemma 2/3 and GPT-OSS, mixed with full layers), attention sinks and MoE routing (GPT-OSS,
Qwen3-MoE), logit soft-capping (Gemma 2), scaled embeddings (Gemma), absolute position embeddings
and a final norm outside ``model.norm`` (GPT-2, GPT-NeoX, LFM2, Falcon-H1). Windows are 5 tokens,
sequences up to 24, so every sliding layer drops keys in prefill, in the cache and inside draft trees.
Recurrent layers (Gated DeltaNet in Qwen3.5 and Qwen3-Next, LFM2's short convolutions, Falcon-H1's
Mamba-2) run plain and chain decoding with right padding; trees and left padding are refused
(tests/test_recurrent.py).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from families import DRAFT_SCALE, FAMILIES, STATEFUL, VOCAB, WINDOW, WINDOWED, build, cached, rel_tol
from hsx.align import ModelShape, parse_layers
from hsx.demo.models import perturbed_copy
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings
from hsx.engine.families import AttentionPlan, find_layout
from hsx.errors import HsxError
from hsx.heads.load import Eagle3Head
from oracle import FINAL_NORM, logits_of, oracle_rows, oracle_sources

# states of these models reach ~165 (like real ones, unlike |h| < 1 at the usual 0.02 init): rows must
# be within 1e-4 plus 1e-5 of the group's largest reference value (fp32 batched vs unbatched ~1e-7 relative)
TOL, REL_TOL = 1e-4, 1e-5
CHAIN = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
TREE = SpecSettings(num_steps=3, topk=4, num_draft_tokens=8)
SPECS = {"plain": None, "chain": CHAIN, "tree": TREE}
LENGTHS, MAX_NEW = (1, 6, 14), 10  # prompts shorter and longer than the window, sequences up to 24
ALL = list(FAMILIES)


def supported(family: str, mode: str, padding: str = "right", generate: bool = True) -> bool:
    """Families whose layers keep a state per row (recurrent layers, DeepSeek-V4's compressors) draft chains and
    pad on the right (the rest is refused: tests/test_recurrent.py)."""
    return family not in STATEFUL or (mode != "tree" and padding == "right")


PADDINGS = ("right", "left")
GENERATE_CASES = [(f, m, p) for f in ALL for m in SPECS for p in PADDINGS if supported(f, m, p)]
PREFILL_CASES = [(f, p) for f in ALL for p in PADDINGS if supported(f, "plain", p, generate=False)]
SPEC_CASES = [(f, m) for f in ALL for m in ("chain", "tree") if supported(f, m)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def draft(family: str):
    # close enough to the target to accept some drafts and reject others
    return perturbed_copy(cached(family), scale=DRAFT_SCALE.get(family, 0.05), seed=1)


def groups_for(model):
    # boundaries 0 and L, a middle one, final, and eagle3 ids [0, 2, 3] -> boundaries (1, 3, 4); on a
    # hyper-connection model final is one stream wide, the boundaries all of them (test_deepseek_v4_...)
    return parse_layers("final,eagle3,0,2,4", ModelShape.from_config(model.config), eagle3_ids=[0, 2, 3])


def engine(family: str, mode: str = "plain", padding: str = "right") -> HFEngine:
    model = cached(family)
    spec = SPECS[mode]
    return HFEngine(model, groups_for(model), draft_model=None if spec is None else draft(family), spec=spec,
                    store_dtype=torch.float32, padding_side=padding)


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"r{i}", torch.randint(0, VOCAB, (n,), generator=gen)) for i, n in enumerate(lengths)]


def close(got: torch.Tensor, want: torch.Tensor, rel: float = REL_TOL) -> tuple[bool, float]:
    """Within tolerance, and the largest difference relative to the largest reference value."""
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    return diff <= TOL + rel * scale, diff / max(scale, 1e-30)


def check_oracle(model, sample, groups, teacher_forced: bool, name: str = "sample", rel: float = REL_TOL) -> float:
    """Every stored row of every group equals the oracle; greedy completions are the oracle's argmax.
    Returns the worst difference relative to the largest reference value."""
    ref = oracle_rows(model, sample.input_ids, groups)
    n = sample.input_ids.numel()
    rows = n if teacher_forced else n - 1  # generate mode: the last token is never fed back
    worst = 0.0
    for g in groups:
        got = sample.hidden[g.name]
        assert got.shape == (rows, g.width), (name, g.name, got.shape)
        ok, diff = close(got, ref[g.name][:rows], rel)
        assert ok, f"{name} {g.name}: max |diff| is {diff:.2e} of the largest reference value"
        worst = max(worst, diff)
    if not teacher_forced:
        with torch.no_grad():
            greedy = logits_of(model, oracle_sources(model, sample.input_ids)["final"]).argmax(-1)  # [n]
        p = sample.prompt_len
        assert torch.equal(sample.input_ids[p:], greedy[p - 1: n - 1]), f"{name}: not the oracle's greedy tokens"
    return worst


# ---- the grid --------------------------------------------------------------------------------

@pytest.mark.parametrize("family,mode,padding", GENERATE_CASES)
def test_generate_rows_equal_oracle(family, mode, padding):
    eng = engine(family, mode, padding)
    samples = eng.generate(prompts(LENGTHS), SamplingSettings(max_new_tokens=MAX_NEW))
    for sample, (rid, p) in zip(samples, prompts(LENGTHS)):
        assert torch.equal(sample.input_ids[: p.numel()], p)
        assert sample.input_ids.numel() - p.numel() == MAX_NEW and sample.finish_reason == "length"
        assert sample.num_rows == sample.input_ids.numel() - 1
        check_oracle(cached(family), sample, eng.groups, teacher_forced=False, name=rid, rel=rel_tol(family, REL_TOL))
    if mode != "plain":
        accepts = torch.cat([s.accept_lens for s in samples]).long()
        assert bool((accepts == 1).any()) and bool((accepts > 1).any()), accepts  # drafts accepted and rejected


@pytest.mark.parametrize("family,padding", PREFILL_CASES)
def test_prefill_rows_equal_oracle(family, padding):
    eng = engine(family, padding=padding)
    reqs = prompts((9, 1, 4, 23), seed=3)
    for sample, (rid, ids) in zip(eng.prefill(reqs), reqs):
        assert torch.equal(sample.input_ids, ids) and sample.finish_reason == "prefill"
        check_oracle(cached(family), sample, eng.groups, teacher_forced=True, name=rid, rel=rel_tol(family, REL_TOL))


@pytest.mark.parametrize("family,mode", SPEC_CASES)
def test_batch_invariance(family, mode):
    # a request decodes the same tokens with the same accept lengths alone and in a padded batch
    reqs = prompts((5, 1, 12), seed=4)
    sampling = SamplingSettings(max_new_tokens=12)
    alone = [engine(family, mode).generate([r], sampling)[0] for r in reqs]
    for padding in [p for p in PADDINGS if supported(family, mode, p)]:
        for (rid, _), a, b in zip(reqs, alone, engine(family, mode, padding).generate(reqs, sampling)):
            assert torch.equal(a.input_ids, b.input_ids), (padding, rid)
            assert torch.equal(a.accept_lens, b.accept_lens), (padding, rid)
            for name in a.hidden:
                assert close(b.hidden[name], a.hidden[name])[0], (padding, rid, name)


# ---- what the grid relies on -----------------------------------------------------------------

def test_prefill_past_the_window_is_exact():
    # a 56-token sequence with a 16-token window: 40 rows sit past the window
    model = build("mistral", sliding_window=16)
    groups = groups_for(model)
    (ids,) = [p for _, p in prompts((56,), seed=5)]
    (sample,) = HFEngine(model, groups, store_dtype=torch.float32).prefill([("long", ids)])
    check_oracle(model, sample, groups, teacher_forced=True)
    # the window matters here: the same weights with full attention give other rows past it
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    far = (oracle_rows(full, ids, groups)["final"] - sample.hidden["final"]).abs().amax(-1)  # [56]
    assert bool((far[16:] > 1e-3).all()) and bool((far[:16] <= 1e-4).all()), far


@pytest.mark.parametrize("mode", ["plain", "tree"])
def test_generate_past_the_window_is_exact(mode):
    model = build("mistral", sliding_window=16)
    spec = SPECS[mode]
    d = None if spec is None else perturbed_copy(model, 0.15, seed=1)
    eng = HFEngine(model, groups_for(model), draft_model=d, spec=spec, store_dtype=torch.float32)
    for sample in eng.generate(prompts((20, 3), seed=6), SamplingSettings(max_new_tokens=30)):
        check_oracle(model, sample, eng.groups, teacher_forced=False)


@pytest.mark.parametrize("family", ALL)
def test_final_norm_found_from_the_module_tree(family):
    model = cached(family)
    assert find_layout(model).final_norm == FINAL_NORM.get(model.config.model_type, "model.norm")


def _embedding_rows(family, model, ids):
    """Boundary 0 written out per family: what transformers' hidden_states[0] is."""
    if family == "gpt2":  # token + absolute position embeddings
        return model.transformer.wte.weight[ids] + model.transformer.wpe.weight[torch.arange(ids.numel())]
    if family == "gpt_neox":
        return model.gpt_neox.embed_in.weight[ids]
    rows = model.model.embed_tokens.weight[ids]
    if family.startswith("gemma"):  # Gemma scales the embedding by sqrt(hidden)
        rows = rows * torch.tensor(model.config.hidden_size ** 0.5, dtype=rows.dtype)
    if family == "falcon_h1":  # muP: a multiplier on the embedding
        rows = rows * model.config.embedding_multiplier
    if family == "deepseek_v4":  # every hyper-connection stream starts as the embedding
        rows = rows.repeat(1, model.config.hc_mult)
    return rows


@pytest.mark.parametrize("family", ALL)
def test_boundary_zero_is_the_family_embedding(family):
    model = cached(family)
    groups = parse_layers("0", ModelShape.from_config(model.config))
    ids = prompts((7,))[0][1]
    (sample,) = HFEngine(model, groups, store_dtype=torch.float32).prefill([("e", ids)])
    with torch.no_grad():
        assert float((sample.hidden["b0"] - _embedding_rows(family, model, ids)).abs().max()) <= 1e-6


def _without(family: str, feature: str):
    model = copy.deepcopy(cached(family))
    with torch.no_grad():
        if feature == "sinks":
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no attention
        elif feature == "softcap":
            model.config.attn_logit_softcapping = None
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        elif feature == "per_layer_inputs":  # every block's per-layer input zero
            model.model.embed_tokens_per_layer.weight.zero_()
            model.model.per_layer_model_projection.weight.zero_()
        elif feature == "chunks":  # one chunk longer than every test sequence: plain causal attention
            model.config.attention_chunk_size = 512
        elif feature == "routing":  # send every token to the same experts
            router = "router" if family == "gpt_oss" else "gate"
            for layer in model.model.layers:
                getattr(layer.mlp, router).weight.zero_()
    return model


@pytest.mark.parametrize("family,feature", [("gpt_oss", "sinks"), ("gemma2", "softcap"), ("llama4_text", "chunks"),
                                            ("gemma4", "per_layer_inputs"),
                                            ("gpt_oss", "routing"), ("qwen3_moe", "routing")])
def test_family_features_are_live(family, feature):
    # the tiny configs exercise each feature: without it the oracle's rows change
    model, ids = cached(family), prompts((12,))[0][1]
    groups = parse_layers("final", ModelShape.from_config(model.config))
    moved = (oracle_rows(model, ids, groups)["final"] - oracle_rows(_without(family, feature), ids, groups)["final"])
    assert float(moved.abs().max()) > 1e-2


@pytest.mark.parametrize("family", WINDOWED)
def test_windowed_families_have_a_short_window(family):
    plan = AttentionPlan.from_model(cached(family), "target")
    assert plan.windows.get("sliding_attention") == WINDOW
    assert ("full_attention" in plan.windows) == (family in ("gemma2", "gemma3", "gpt_oss", "mimo_v2_flash", "gemma4"))


def test_chunked_layers_see_their_own_chunk_only():
    plan = AttentionPlan.from_model(cached("llama4_text"), "target")
    assert plan.windows == {"chunked_attention": WINDOW, "full_attention": None} and plan.per_type
    # positions 0..11 against keys 0..11: chunks [0, 5), [5, 10), [10, 12)
    pos = torch.arange(12)[None]
    mask = plan.masks(torch.ones(1, 12, 12, dtype=torch.bool).tril(), pos, pos, torch.float32)["chunked_attention"]
    seen = mask[0, 0] == 0
    assert seen[7].nonzero()[:, 0].tolist() == [5, 6, 7] and seen[10].nonzero()[:, 0].tolist() == [10]


def test_llama4_temperature_tuning_is_exact_within_its_slot_limit_and_refused_past_it():
    # NoPE layers scale queries by a function of the cache slot index, which is 1 below floor_scale - 1
    model = build("llama4_text", floor_scale=12, attn_scale=0.5)
    groups = _groups(model)
    eng = HFEngine(model, groups, store_dtype=torch.float32)
    for sample in eng.generate(prompts((3, 6)), SamplingSettings(max_new_tokens=3)):
        check_oracle(model, sample, groups, teacher_forced=False)
    with pytest.raises(HsxError, match=r"llama4_text: a forward over 14 cache slots; this model reads a slot index "
                                       r"as a position .* exact within 11 slots"):
        eng.prefill(prompts((14,)))


# ---- refusals --------------------------------------------------------------------------------

def _groups(model):
    return parse_layers("final", ModelShape.from_config(model.config))


def test_bidirectional_gemma3_is_refused():
    model = build("gemma3", use_bidirectional_attention=True)
    with pytest.raises(HsxError, match=r"gemma3_text.*use_bidirectional_attention"):
        HFEngine(model, _groups(model))


def test_unknown_layer_type_is_refused_by_name():
    model = build("llama", attention_chunk_size=4)  # read by transformers as chunked attention
    with pytest.raises(HsxError, match=r"\(llama\): layer 0 is of type 'chunked_attention'"):
        HFEngine(model, _groups(model))


def test_deepseek_v4_boundaries_are_its_streams_in_order():
    # every boundary is the 4 hyper-connection streams, [T, 4, 64] flattened stream by stream to 256; boundary L
    # is the last block's streams, before hc_head collapses them into the final norm's input
    model = cached("deepseek_v4")
    shape = ModelShape.from_config(model.config)
    assert (shape.hc_mult, shape.hidden_size, shape.unit_width) == (4, 64, 256)
    groups = parse_layers("eagle3,0,2,4", shape, eagle3_ids=[0, 2, 3])
    assert [g.width for g in groups] == [768, 256, 256, 256]
    ids = prompts((13,))[0][1]
    (sample,) = HFEngine(model, groups, store_dtype=torch.float32).prefill([("s", ids)])
    outputs = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, b=i + 1: outputs.__setitem__(b, out[0]))
             for i, layer in enumerate(model.model.layers)]
    hooks.append(model.model.hc_head.register_forward_pre_hook(lambda m, a: outputs.__setitem__("hc_in", a[0][0])))
    with torch.no_grad():
        model(input_ids=ids[None])
    for h in hooks:
        h.remove()
    assert torch.equal(outputs["hc_in"], outputs[4])  # the collapse reads the last block's streams
    for column, b in (("b2", 2), ("b4", 4)):
        for stream in range(4):
            got = sample.hidden[column][:, 64 * stream: 64 * (stream + 1)]
            want = outputs[b][:, stream]
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (column, stream)
    # the eagle3 column is its three boundaries side by side, each all four streams
    assert torch.equal(sample.hidden["eagle3"][:, 512:], sample.hidden["b4"])


def test_deepseek_v4_final_is_lm_head_input_one_stream_wide():
    # final is what lm_head reads: hc_head's collapse of the last block's streams, then the final norm
    model = cached("deepseek_v4")
    groups = parse_layers("final,4", ModelShape.from_config(model.config))
    assert [g.width for g in groups] == [64, 256]
    ids = prompts((13,))[0][1]
    (sample,) = HFEngine(model, groups, store_dtype=torch.float32).prefill([("s", ids)])
    box = {}
    hook = model.lm_head.register_forward_pre_hook(lambda m, a: box.__setitem__("head_in", a[0][0]))
    with torch.no_grad():
        model(input_ids=ids[None])
    hook.remove()
    assert sample.hidden["final"].shape == (13, 64)
    assert float((sample.hidden["final"] - box["head_in"]).abs().max()) <= 1e-5 * float(box["head_in"].abs().max())


def test_deepseek_v4_trees_and_left_padding_are_refused_naming_the_kinds():
    model = cached("deepseek_v4")
    groups = parse_layers("final,4", ModelShape.from_config(model.config))
    kinds = r"'heavily_compressed_attention', 'compressed_sparse_attention' layers"
    with pytest.raises(HsxError, match=rf"target model \(deepseek_v4\): {kinds} keep one state per row, which a draft "
                                       r"tree's branches cannot share; draft a chain"):
        HFEngine(model, groups, draft_model=draft("deepseek_v4"), spec=TREE)
    with pytest.raises(HsxError, match=rf"target model \(deepseek_v4\): {kinds} keep a state per row, which left "
                                       r"padding would enter before the prompt"):
        HFEngine(model, groups, padding_side="left")


def test_attention_implementation_that_ignores_masks_is_refused():
    model = copy.deepcopy(cached("gemma3"))
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(HsxError, match=r"target model \(gemma3_text\): attention implementation 'flex_attention'"):
        HFEngine(model, _groups(model))


def test_model_without_a_final_norm_is_refused():
    model = copy.deepcopy(cached("llama"))
    model.model.norm = torch.nn.Identity()
    with pytest.raises(HsxError, match=r"\(llama\): no normalisation module after the decoder blocks 'model.layers'"):
        HFEngine(model, _groups(model))


def test_a_norm_that_does_not_feed_lm_head_is_not_taken_for_the_final_norm():
    model = copy.deepcopy(cached("llama"))
    # a norm registered after the blocks that the forward never calls: the 4-token forward passes it over
    model.model.add_module("unused_norm", torch.nn.LayerNorm(model.config.hidden_size))
    assert find_layout(model).final_norm == "model.norm"
    groups = _groups(model)
    (sample,) = HFEngine(model, groups, store_dtype=torch.float32).prefill(prompts((6,)))
    check_oracle(model, sample, groups, teacher_forced=True)


# ---- hsx extract on hybrid families ----------------------------------------------------------

CHATS = [
    {"id": "tides", "messages": [{"role": "user", "content": "How do tides work, and why are there two a day?"}]},
    {"id": "bread", "messages": [{"role": "system", "content": "Answer in one line."},
                                 {"role": "user", "content": "What is bread made of?"},
                                 {"role": "assistant", "content": "Flour, water, salt and yeast."},
                                 {"role": "user", "content": "And how long does it rise?"}]},
    {"id": "river", "text": "The river ran past the old mill and under the stone bridge to the sea."},
    {"id": "bees", "text": "Bees"},
]


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_hsx_extract_tree_decoding_past_the_window(family, tmp_path):
    import json

    from typer.testing import CliRunner

    import hsx
    from hsx.cli import app
    from hsx.demo.tokenizer import build_demo_tokenizer

    tok = build_demo_tokenizer()
    target = build(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                   bos_token_id=tok.bos_token_id)
    for name, model in (("target", target), ("draft", perturbed_copy(target, DRAFT_SCALE.get(family, 0.05), 1))):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    out = tmp_path / "out"
    args = ["extract", "--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"),
            "--dataset", str(data), "--id-field", "id", "--output", str(out), "--layers", "final,eagle3,0,4",
            "--dtype", "float32", "--model-dtype", "float32", "--spec-num-steps", "3", "--spec-topk", "4",
            "--spec-num-draft-tokens", "8", "--max-new-tokens", "16", "--batch-size", "4", "--quiet"]
    runner = CliRunner()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
    ds = hsx.open(out)
    assert ds.sample_ids == [r["id"] for r in CHATS]
    groups = parse_layers("final,eagle3,0,4", ModelShape.from_config(target.config))
    checked = 0
    for s in ds:
        assert s.prompt_len > WINDOW or s.sample_id == "bees", (s.sample_id, s.prompt_len)
        sample_rows = {g.name: s.hidden(g.name).float() for g in groups}
        ids = s.input_ids.long()
        ref = oracle_rows(target, ids, groups)
        rows = ids.numel() - 1
        for g in groups:
            assert sample_rows[g.name].shape == (rows, g.width)
            assert close(sample_rows[g.name], ref[g.name][:rows])[0], (s.sample_id, g.name)
            checked += rows
        assert s.input_ids.numel() > WINDOW * 3  # the completion runs well past the window
    accepts = torch.cat([s.accept_lens for s in ds]).long()
    assert bool((accepts == 1).any()) and bool((accepts > 1).any()), accepts
    assert checked > 0


# ---- EAGLE3 heads on every attention family ----------------------------------------------------
# (the recurrent families and DeepSeek-V4 have theirs in tests/test_recurrent.py and tests/test_compressed.py)

def random_head(model, seed: int = 0, vocab: int = VOCAB):
    """A random EAGLE3 head drafting from boundaries 0, 1 and 2 of ``model`` (its text model, on a
    vision-language target) for a target vocabulary of ``vocab``."""
    hidden = model.config.get_text_config(decoder=True).hidden_size
    config = {"hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 2 * hidden,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Eagle3Head(config, model.get_input_embeddings(), vocab).float().eval()


@pytest.mark.parametrize("family,mode", [(f, m) for f in ALL if f not in STATEFUL for m in ("chain", "tree")])
def test_an_eagle3_head_drafts_for_every_attention_family(family, mode):
    model = cached(family)
    eng = HFEngine(model, groups_for(model), draft_model=random_head(model), spec=SPECS[mode],
                   store_dtype=torch.float32)
    reqs = prompts((5, 11, 2), seed=9)
    samples = eng.generate(reqs, SamplingSettings(max_new_tokens=8))
    for sample, (rid, _) in zip(samples, reqs):
        check_oracle(model, sample, eng.groups, teacher_forced=False, name=rid, rel=rel_tol(family, REL_TOL))
    assert all(int(s.accept_lens.numel()) > 0 for s in samples)
