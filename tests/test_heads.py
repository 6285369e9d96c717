"""EAGLE3 heads as the transformers engine's draft, and strict model loads.

The target and head are hsx.demo.spec_models' (the prompt's last token sets the regime: follow,
mixed, miss). Every stored row is compared with the oracle (tests/oracle.py); the tokens with
plain greedy decoding of the target alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hsx.align import ModelShape, parse_layers
from hsx.demo.models import build_tiny_llama
from hsx.demo.spec_models import EAGLE3_IDS, build_spec_models
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings, load_hf_engine
from hsx.engine.families import load_causal_lm
from hsx.heads.load import Eagle3Head, head_kind, load_eagle3_head
from hsx.errors import HsxError
from oracle import oracle_rows

TOL = 1e-4
CHAIN = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
TREE = SpecSettings(num_steps=3, topk=2, num_draft_tokens=6)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    models = build_spec_models(root / "spec")
    target = load_causal_lm(str(models.target), torch.float32, what="target model").eval()
    # a head whose attention changes its output (the built one's o_proj is zero): positions, the
    # head's cache and its masks then decide its drafts
    live = root / "live"
    shutil.copytree(models.eagle3, live)
    w = load_file(str(live / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    w["midlayer.self_attn.o_proj.weight"] = torch.randn(w["midlayer.self_attn.o_proj.weight"].shape, generator=g) * 0.3
    save_file(w, str(live / "model.safetensors"))
    return models, target, live


def groups_for(model):
    return parse_layers("final,eagle3,0,8", ModelShape.from_config(model.config), eagle3_ids=EAGLE3_IDS)


def make_prompts(models, regimes, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    everything = torch.tensor(sum(models.classes.values(), []))
    out = []
    for i, (regime, n) in enumerate(zip(regimes, lengths)):
        ids = everything[torch.randint(len(everything), (n,), generator=g)]
        cls = torch.tensor(models.classes[regime])
        ids[-1] = cls[torch.randint(len(cls), (1,), generator=g)]
        out.append((f"{regime}{i}", ids))
    return out


def head_engine(built, spec, head_dir=None, padding="right"):
    models, target, _ = built
    head = load_eagle3_head(head_dir or models.eagle3, target, torch.float32)
    return HFEngine(target, groups_for(target), draft_model=head, spec=spec, store_dtype=torch.float32,
                    padding_side=padding)


def check_oracle(model, sample, groups):
    ref = oracle_rows(model, sample.input_ids, groups)
    rows = sample.input_ids.numel() - 1
    for g in groups:
        got = sample.hidden[g.name]
        assert got.shape == (rows, g.width), (g.name, got.shape)
        diff = float((got - ref[g.name][:rows]).abs().max())
        assert diff <= TOL, f"{g.name}: max diff {diff}"


def plain_greedy(built, reqs, max_new):
    models, target, _ = built
    eng = HFEngine(target, groups_for(target), store_dtype=torch.float32)
    return eng.generate(reqs, SamplingSettings(max_new_tokens=max_new))


# ---- drafting --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_head_rows_equal_oracle_and_regimes_as_built(built, spec):
    models, target, _ = built
    regimes = ["follow", "mixed", "miss", "follow", "miss"]
    reqs = make_prompts(models, regimes, [1, 9, 30, 17, 4])
    max_new = 14  # 1 from the prefill + steps of up to 4 (chain) / 4 (tree depth 3 + bonus): the last overshoots
    eng = head_engine(built, spec)
    samples = eng.generate(reqs, SamplingSettings(max_new_tokens=max_new))
    for sample, ref, regime in zip(samples, plain_greedy(built, reqs, max_new), regimes):
        assert torch.equal(sample.input_ids, ref.input_ids), regime  # a draft never changes greedy tokens
        assert sample.input_ids.numel() - sample.prompt_len == max_new
        check_oracle(target, sample, eng.groups)
        a = sample.accept_lens.long()
        assert int(a.sum()) >= max_new - 1  # the steps covered every completion token after the first
        assert int(a[:-1].sum()) < max_new - 1  # and the last step was needed
        if regime == "follow":
            assert bool((a == spec.num_steps + 1).all()), (regime, a)
        elif regime == "miss":
            assert bool((a == 1).all()), (regime, a)
        else:
            assert bool((a == 1).any()) and bool((a > 1).any()), (regime, a)


def test_head_overshoot_is_trimmed(built):
    models, target, _ = built
    reqs = make_prompts(models, ["follow", "follow"], [3, 12], seed=1)
    eng = head_engine(built, CHAIN)
    samples = eng.generate(reqs, SamplingSettings(max_new_tokens=7))
    for sample in samples:
        assert sample.accept_lens.tolist() == [4, 4]  # 1 + 4 + 4 = 9 emitted, 7 kept
        assert sample.input_ids.numel() - sample.prompt_len == 7
        assert sample.num_rows == sample.input_ids.numel() - 1
        check_oracle(target, sample, eng.groups)


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_live_head_drafts_do_not_depend_on_batch_neighbours(built, spec):
    models, target, live = built
    reqs = make_prompts(models, ["mixed", "follow", "mixed"], [5, 1, 23], seed=2)
    sampling = SamplingSettings(max_new_tokens=16)
    alone = [head_engine(built, spec, live).generate([r], sampling)[0] for r in reqs]
    for padding in ("right", "left"):
        batched = head_engine(built, spec, live, padding).generate(reqs, sampling)
        for a, b in zip(alone, batched):
            assert torch.equal(a.input_ids, b.input_ids)
            assert a.accept_lens.tolist() == b.accept_lens.tolist(), padding
            check_oracle(target, b, groups_for(target))
    assert len({tuple(s.accept_lens.tolist()) for s in alone}) > 1


def test_live_head_steps_equal_one_uncached_forward(built):
    """The head's cached, masked steps give what one forward over the whole sequence gives."""
    models, target, live = built
    head = load_eagle3_head(live, target, torch.float32)
    g = torch.Generator().manual_seed(3)
    T, W = 9, head.target_hidden * head.num_aux
    ids = torch.randint(0, head.target_vocab, (1, T), generator=g)
    aux = torch.randn(1, T, W, generator=g)
    pos = torch.arange(T)[None]
    causal = torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))[None, None]
    with torch.no_grad():
        full = head(ids, pos, causal, cache=None, draft_hidden=aux)
        from transformers import DynamicCache

        cache = DynamicCache()
        first = head(ids[:, :5], pos[:, :5], causal[..., :5, :5], cache=cache, draft_hidden=aux[:, :5])
        rest = head(ids[:, 5:], pos[:, 5:], causal[..., 5:, :], cache=cache, draft_hidden=aux[:, 5:])
    got = torch.cat([first.logits, rest.logits], 1)
    finite = torch.isfinite(full.logits)
    assert int(finite.sum()) == T * head.draft_vocab
    assert float((got[finite] - full.logits[finite]).abs().max()) < 1e-4
    # the draft vocabulary lands on the target ids d + d2t[d]
    d2t = load_file(str(live / "model.safetensors"))["d2t"]
    assert torch.equal(torch.isfinite(full.logits[0, 0]).nonzero()[:, 0].sort().values,
                       (torch.arange(head.draft_vocab) + d2t).sort().values)


def test_head_through_load_hf_engine(built):
    models, target, _ = built
    eng = load_hf_engine(str(models.target), "final,eagle3", draft_path=str(models.eagle3), spec=CHAIN,
                         eagle3_ids=EAGLE3_IDS, dtype=torch.float32, store_dtype=torch.float32)
    assert isinstance(eng.draft_model, Eagle3Head) and eng.aux_sources == (2, 4, 6)
    reqs = make_prompts(models, ["follow"], [6], seed=4)
    sample = eng.generate(reqs, SamplingSettings(max_new_tokens=9))[0]
    assert sample.accept_lens.tolist() == [4, 4]
    check_oracle(target, sample, eng.groups)


# ---- the head loader's refusals ---------------------------------------------------------------

def edited_head(src: Path, dst: Path, config=None, drop=(), add=None, reshape=None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in (config or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(dst / "model.safetensors"))
    for k in drop:
        del w[k]
    w.update(add or {})
    for k, shape in (reshape or {}).items():
        w[k] = torch.zeros(shape)
    save_file(w, str(dst / "model.safetensors"))
    return dst


def test_head_format_is_detected(built):
    models, _, _ = built
    assert head_kind(models.eagle3) == "eagle3"
    assert head_kind(models.eagle) == "eagle"
    assert head_kind(models.target) is None


@pytest.mark.parametrize("case, edit, message", [
    ("width", dict(config={"target_hidden_size": 64}), "target_hidden_size 64 but the target's hidden_size is 128"),
    ("ids", dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}}), "[1, 3, 8] outside 0..7"),
    ("d2t", dict(config={"draft_vocab_size": 100}, drop=["d2t"], reshape={"lm_head.weight": (100, 128)}),
     "missing ['d2t']"),
    ("layer", dict(drop=["midlayer.mlp.up_proj.weight"]), "missing ['midlayer.mlp.up_proj.weight']"),
    ("unexpected", dict(add={"midlayer.extra.weight": torch.zeros(3)}), "unexpected ['midlayer.extra.weight']"),
    ("shape", dict(reshape={"fc.weight": (128, 256)}), "fc.weight (checkpoint (128, 256), head (128, 384))"),
    ("layers", dict(config={"num_hidden_layers": 2}), "num_hidden_layers = 2"),
    ("no draft vocab", dict(config={"draft_vocab_size": None}), "no draft_vocab_size"),
])
def test_head_refusals(built, tmp_path, case, edit, message):
    models, target, _ = built
    bad = edited_head(models.eagle3, tmp_path / "bad", **edit)
    with pytest.raises(HsxError) as e:
        load_eagle3_head(bad, target, torch.float32)
    assert message in str(e.value) and str(bad) in str(e.value)


def test_d2t_out_of_range_is_refused(built, tmp_path):
    models, target, _ = built
    d2t = load_file(str(models.eagle3 / "model.safetensors"))["d2t"].clone()
    d2t[-1] += 5000
    bad = edited_head(models.eagle3, tmp_path / "bad", add={"d2t": d2t})
    with pytest.raises(HsxError, match="outside"):
        load_eagle3_head(bad, target, torch.float32)


def test_eagle_head_is_refused_by_name(built):
    models, _, _ = built
    with pytest.raises(HsxError, match="LlamaForCausalLMEagle"):
        load_hf_engine(str(models.target), "final", draft_path=str(models.eagle), spec=CHAIN, dtype=torch.float32)


# ---- strict loads ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "m"
    build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=64).save_pretrained(path)
    return path


def test_complete_checkpoint_loads(saved_llama):
    load_causal_lm(str(saved_llama), torch.float32)


def test_missing_weight_is_refused(saved_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(saved_llama, bad)
    w = load_file(str(bad / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HsxError, match=r"missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_causal_lm(str(bad), torch.float32, what="target model")
    with pytest.raises(HsxError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_engine(str(bad), "final", dtype=torch.float32)


def test_unexpected_weight_is_refused(saved_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(saved_llama, bad)
    w = load_file(str(bad / "model.safetensors"))
    w["model.layers.0.mystery.weight"] = torch.zeros(4)
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HsxError, match=r"unexpected .*model\.layers\.0\.mystery\.weight"):
        load_causal_lm(str(bad), torch.float32)


def test_head_loaded_as_a_plain_llama_is_refused(built):
    """What used to happen silently: a head directory read as LlamaForCausalLM has no decoder weights."""
    models, _, _ = built
    with pytest.raises(HsxError) as e:
        load_causal_lm(str(models.eagle3), torch.float32, what="draft model")
    assert "model.layers.0.self_attn.q_proj.weight" in str(e.value) and "midlayer" in str(e.value)


def test_extract_runner_refuses_incomplete_draft(built, saved_llama, tmp_path):
    from hsx.config import ExtractConfig
    from hsx.engine.hf.runner import HFRunner

    models, _, _ = built
    bad = tmp_path / "bad"
    shutil.copytree(saved_llama, bad)
    w = load_file(str(bad / "model.safetensors"))
    del w["lm_head.weight"]
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    cfg = ExtractConfig(model=str(models.target), draft_model=str(bad), dataset="x", layers="final",
                        device="cpu", model_dtype="float32")
    with pytest.raises(HsxError, match=r"draft model .*lm_head\.weight"):
        HFRunner(cfg)


class _Recorder:
    """Every call of a head: its tokens, positions, hidden inputs, pre-norm outputs and logits."""

    def __init__(self, head):
        self.calls = []
        self.handle = head.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, out):
        ids, pos = (kwargs.get("input_ids", args[0] if args else None), kwargs.get("position_ids"))
        self.calls.append((ids.clone(), pos.clone(), kwargs["draft_hidden"].clone(), out.hidden.clone(),
                           out.logits.clone()))


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_head_reads_the_next_token_with_the_aux_state_at_each_position(built, spec):
    """What SGLang's EAGLE3 worker gives the head: at position p the token p+1 and the target's states
    at boundaries id+1 after token p (draft extend); a draft step at depth d reads its parent's output
    at position root + d - 1."""
    models, target, live = built
    head = load_eagle3_head(live, target, torch.float32)
    eng = HFEngine(target, groups_for(target), draft_model=head, spec=spec, store_dtype=torch.float32)
    aux_group = parse_layers("eagle3", ModelShape.from_config(target.config), eagle3_ids=EAGLE3_IDS)
    assert aux_group[0].sources == (2, 4, 6)
    width = head.target_hidden * head.num_aux
    for regime, n in (("mixed", 7), ("follow", 1), ("mixed", 20)):
        req = make_prompts(models, [regime], [n], seed=n)
        rec = _Recorder(head)
        try:
            sample = eng.generate(req, SamplingSettings(max_new_tokens=12))[0]
        finally:
            rec.handle.remove()
        seq = sample.input_ids
        aux = oracle_rows(target, seq, aux_group)["eagle3"]  # [N, 3H] teacher-forced
        extends = steps = steps_in_tree = 0
        (ids, pos, hid, _, _), calls = rec.calls[0], rec.calls[1:]
        # the prompt's extend: its last slot waits for the first completion token (and is dropped)
        assert hid.shape[-1] == width and torch.equal(pos[0], torch.arange(n))
        assert torch.equal(ids[0, :-1], seq[1:n]) and torch.allclose(hid[0, :-1], aux[:n - 1], atol=TOL, rtol=0)
        for ids, pos, hid, out, logits in calls:
            ids, pos, hid, out, logits = ids[0], pos[0], hid[0], out[0], logits[0]
            if hid.shape[-1] == width:  # draft extend of the last step's accepted path (or the first token)
                extends += 1
                assert torch.equal(ids, seq[pos + 1]), (regime, pos)
                assert float((hid - aux[pos]).abs().max()) < TOL, (regime, pos)
                last_pos = int(pos[-1])
                parent_out, parent_logits = out[-1:], logits[-1:]
            else:  # a draft step: frontier nodes one level deeper each call
                steps += 1
                assert torch.equal(pos, torch.full_like(pos, last_pos + steps_in_tree + 1)), (pos, last_pos)
                # each node reads the output of the call that proposed it, and is one of its top-k tokens
                for token, h in zip(ids.tolist(), hid):
                    same = (parent_out == h).all(-1).nonzero()[:, 0]
                    assert same.numel() >= 1
                    assert any(token in parent_logits[j].topk(spec.topk).indices.tolist() for j in same.tolist())
                parent_out, parent_logits = out, logits
            steps_in_tree = 0 if hid.shape[-1] == width else steps_in_tree + 1
        assert extends == sample.accept_lens.numel()
        assert steps == sample.accept_lens.numel() * (spec.num_steps - 1)


def test_sglang_entry_point_checks_target_and_head_before_starting(built, saved_llama, tmp_path, monkeypatch):
    import sys

    from hsx.config import ExtractConfig
    from hsx.engine.sglang.runner import SGLangRunner

    monkeypatch.setitem(sys.modules, "sglang", None)  # the checks come first: SGLang is never imported
    models, _, _ = built
    bad = tmp_path / "bad"
    shutil.copytree(saved_llama, bad)
    w = load_file(str(bad / "model.safetensors"))
    del w["model.norm.weight"]
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    cfg = ExtractConfig(model=str(bad), dataset="x", layers="final", engine="sglang")
    with pytest.raises(HsxError, match=r"target model .*model\.norm\.weight"):
        SGLangRunner(cfg)
    head = edited_head(models.eagle3, tmp_path / "head", drop=["midlayer.hidden_norm.weight"])
    cfg = ExtractConfig(model=str(models.target), draft_model=str(head), dataset="x", layers="eagle3",
                        engine="sglang", spec_algorithm="EAGLE3")
    with pytest.raises(HsxError, match=r"missing \['midlayer\.hidden_norm\.weight'\]"):
        SGLangRunner(cfg)
    # a complete pair passes the checks and gets as far as importing SGLang
    cfg = ExtractConfig(model=str(models.target), draft_model=str(models.eagle3), dataset="x", layers="eagle3",
                        engine="sglang", spec_algorithm="EAGLE3")
    with pytest.raises(HsxError, match=r"pip install 'hsx\[sglang\]'"):
        SGLangRunner(cfg)


@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_prefill_runs_no_head_lm_head_and_gives_the_same_output(built, prefill_chunk):
    """The head's logits are computed when read: the prompt's never are (the prefill reads none), and the
    run gives the bits of one where every head forward computes its logits at once."""
    models, target, live = built
    reqs = make_prompts(models, ["mixed", "follow", "miss"], [5, 11, 23], seed=4)
    runs = {}
    for eager in (False, True):
        head = load_eagle3_head(live, target, torch.float32)
        eng = HFEngine(target, groups_for(target), draft_model=head, spec=CHAIN, store_dtype=torch.float32,
                       prefill_chunk=prefill_chunk)
        calls, phase = [], []
        head.lm_head.register_forward_hook(lambda m, a, out: calls.append((bool(phase), a[0].shape[1])))
        if eager:  # what every head forward did before: logits at every position it ran
            def read_logits(module, args, out):  # returns None: a hook's return value would replace the output
                out.logits

            head.register_forward_hook(read_logits)
        start = eng._start

        def in_prefill(*args, **kwargs):
            phase.append(True)
            try:
                return start(*args, **kwargs)
            finally:
                phase.clear()

        eng._start = in_prefill
        runs[eager] = (eng.generate(reqs, SamplingSettings(max_new_tokens=9)), calls)
    (lazy, lazy_calls), (eager, eager_calls) = runs[False], runs[True]
    assert [q for p, q in eager_calls if p] and not [q for p, q in lazy_calls if p]  # prefill: lm_head before, now none
    assert [q for p, q in lazy_calls if not p] == [q for p, q in eager_calls if not p]  # drafting reads the same ones
    for a, b in zip(lazy, eager):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.accept_lens, b.accept_lens)
        for name in a.hidden:
            assert torch.equal(a.hidden[name], b.hidden[name]), name
    check_oracle(target, lazy[2], groups_for(target))
