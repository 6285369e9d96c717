"""``--engine sglang`` without SGLang: a stand-in ``sglang`` module whose ``Engine`` is driven by the
transformers engine and answers in SGLang 0.5.23's output shape (``output_ids`` plus ``meta_info``
with nested-list ``hidden_states``, ``completion_tokens``, ``num_retractions``, a ``finish_reason``
dict and the spec stat keys). Good outputs must give shards identical to ``--engine hf``'s; each
known hazard (cached prefill, retraction, dropped row, wrong width, refused algorithms, old or
missing SGLang) must be caught.

With hsx's capture (``--sglang-capture tensors``, the default) the stand-in plays SGLang's scheduler
too: when ``forward_hooks`` names hsx's capture factory, each prefill block and verify step the
transformers engine produces goes through the capture's :class:`Writer` as SGLang's result processor
would hand it over (``hidden`` = the column SGLang returns, ``last`` = the post-norm final state
under aux capture), and ``meta_info["hidden_states"]`` comes back empty. Its hazards edit the
capture files: a retraction's second prefill block, a lost step, a scheduler-side error.

The stand-in applies SGLang's own capture rule for aux layer ids (``layers_to_capture = id + 1``),
written out here rather than taken from hsx, so the adapter's translation is checked against it.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hsx
from hsx.align import LayerGroup
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama, perturbed_copy
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.engine.hf.engine import HFEngine, SamplingSettings, SpecSettings
from hsx.engine.hf import engine as hf_engine
from hsx.heads.layer_ids import sglang_boundaries, sglang_ids_for
from hsx.engine.sglang.runner import import_sglang
from hsx.engine.sglang.capture import HOOK_FACTORY, CaptureSpec, Writer, read_records
from hsx.shards.manifest import load_manifest
from hsx.align import Collector
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from hsx.recompute import recompute
from hsx.shards.manifest import load_manifest
from oracle import oracle_sources
from shard_fixtures import rewrite

NUM_LAYERS = 8
HIDDEN = 64

ROWS = [
    {"id": "chat-a", "messages": [{"role": "user", "content": "How do tides work?"}]},
    {"id": "text-b", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "text-c", "text": "Bees"},
    {"id": "chat-d", "messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Name a colour, then explain why you like it."}]},
    {"id": "text-e", "text": "A longer line of plain text, so that the batch holds prompts of rather different lengths."},
]


class FakeEngine:
    """``sglang.Engine`` stand-in: the transformers engine computes, SGLang's output shape comes out."""

    instances: list["FakeEngine"] = []
    hazard = None  # callable(engine, call_no, index, out) -> out, set by a test
    ignore_capture = False  # True: behave as an SGLang that never loaded hsx's capture (float lists come back)

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[list[list[int]]] = []
        load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        model = load(kwargs["model_path"])
        L, H = model.config.num_hidden_layers, model.config.hidden_size
        algorithm = kwargs.get("speculative_algorithm")
        if kwargs.get("enable_return_aux_hidden_states"):
            ids = kwargs.get("return_aux_hidden_state_layer_ids")
            layers = [i + 1 for i in ids] if ids is not None else [2, L // 2, L - 3]
            algorithm = None  # aux capture only: the algorithm just names the convention
        elif algorithm == "EAGLE3":
            draft_cfg = AutoConfig.from_pretrained(kwargs["speculative_draft_model_path"])
            ids = (getattr(draft_cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
            layers = [i + 1 for i in ids] if ids else [2, L // 2, L - 3]
        else:
            layers = None
        group = LayerGroup("out", ("final",), H) if layers is None else LayerGroup("out", tuple(layers), H * len(layers))
        hooks = [h for h in kwargs.get("forward_hooks") or [] if h.get("hook_factory") == HOOK_FACTORY]
        self.capture = None if FakeEngine.ignore_capture or not hooks else CaptureSpec.from_config(hooks[0]["config"])
        groups = [group]
        if self.capture is not None and layers is not None:  # aux capture: SGLang also keeps the final state
            groups.append(LayerGroup("last", ("final",), H))
        draft, spec = None, None
        if algorithm is not None:
            draft = load(kwargs["speculative_draft_model_path"])
            spec = SpecSettings(kwargs["speculative_num_steps"], kwargs["speculative_eagle_topk"],
                                kwargs["speculative_num_draft_tokens"])
        self.speculative = spec is not None
        self.hf = HFEngine(model, groups, draft_model=draft, spec=spec, store_dtype=torch.float32)
        FakeEngine.instances.append(self)

    def generate(self, input_ids=None, sampling_params=None, return_hidden_states=False, rid=None):
        assert return_hidden_states is True and input_ids is not None
        sp = sampling_params
        sampling = SamplingSettings(sp["max_new_tokens"], sp.get("temperature", 0.0), sp.get("top_p", 1.0),
                                    sp.get("sampling_seed", 0), tuple(sp.get("stop_token_ids") or ()))
        call_no = len(self.calls)
        self.calls.append([list(x) for x in input_ids])
        rids = list(rid) if rid is not None else [f"req-{i}" for i in range(len(input_ids))]
        requests = [(i, torch.tensor(x)) for i, x in enumerate(input_ids)]
        if self.capture is None:
            samples = self.hf.generate(requests, sampling)
        else:
            scheduler = Scheduler(self.capture, rids)
            original = hf_engine.Collector
            hf_engine.Collector = scheduler.collector
            try:
                samples = self.hf.generate(requests, sampling)
            finally:
                hf_engine.Collector = original
        outs = []
        for i, (ids, s) in enumerate(zip(input_ids, samples)):
            out = self._output(len(ids), s, sp["max_new_tokens"], rids[i])
            outs.append(FakeEngine.hazard(self, call_no, i, out) if FakeEngine.hazard else out)
        return outs

    def _output(self, P: int, s, max_new_tokens: int, rid: str) -> dict:
        rows = s.hidden["out"]  # [P + C - 1, W]
        C = s.input_ids.numel() - P
        completion = s.input_ids[P:].tolist()
        finish = {"type": "length", "length": C} if s.finish_reason == "length" else {"type": "stop", "matched": completion[-1]}
        listed = [] if self.capture is not None else [rows[:P].tolist()] + rows[P:].tolist()
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": P, "weight_version": "default",
                "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": C, "cached_tokens": 0,
                "hidden_states": listed}
        if self.speculative and s.accept_lens is not None and s.accept_lens.numel():
            a = s.accept_lens.long()
            drafts = self.kwargs["speculative_num_draft_tokens"] - 1
            hist = torch.bincount(a - 1).tolist()
            meta.update(spec_verify_ct=a.numel(), spec_num_correct_drafts=int((a - 1).sum()),
                        spec_num_proposed_drafts=a.numel() * drafts, spec_accept_rate=int((a - 1).sum()) / (a.numel() * drafts),
                        spec_accept_length=C / a.numel(), spec_correct_drafts_histogram=hist)
        return {"output_ids": completion, "meta_info": meta}

    def shutdown(self):
        pass


class Scheduler:
    """SGLang's result processor as the capture sees it: each prefill block and verify step of the
    transformers engine handed to the capture's Writer with SGLang's source names."""

    def __init__(self, spec: CaptureSpec, rids: list[str]):
        self.writer, self.rids = Writer(spec), rids

    def req(self, i):
        return types.SimpleNamespace(rid=self.rids[i], return_hidden_states=True)

    @staticmethod
    def sources(hidden) -> dict:
        return {"hidden": hidden["out"], "last": hidden.get("last")}

    def collector(self, groups, dtype):
        scheduler = self

        class Spy(Collector):
            def prefill(self, rid, prompt_ids, hidden, first_token):
                super().prefill(rid, prompt_ids, hidden, first_token)
                scheduler.writer.prefill([scheduler.req(rid)], scheduler.sources(hidden), [prompt_ids.numel()],
                                         torch.tensor([first_token]), [True])

            def step(self, rids, hidden, tokens, accept_lens, stride):
                super().step(rids, hidden, tokens, accept_lens, stride)
                live = torch.ones(len(rids), dtype=torch.bool)
                # the transformers engine's rows are already at the front of each stride, every column
                scheduler.writer.step([scheduler.req(r) for r in rids], scheduler.sources(hidden), tokens,
                                      accept_lens, stride, live, None)

        return Spy(groups, dtype)


def fake_module(version: str = "0.5.23") -> types.ModuleType:
    mod = types.ModuleType("sglang")
    mod.__version__ = version
    mod.Engine = FakeEngine
    return mod


@pytest.fixture(autouse=True)
def fake_sglang(monkeypatch):
    FakeEngine.instances, FakeEngine.hazard, FakeEngine.ignore_capture = [], None, False
    monkeypatch.setitem(sys.modules, "sglang", fake_module())
    yield
    FakeEngine.hazard, FakeEngine.ignore_capture = None, False


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=NUM_LAYERS, hidden_size=HIDDEN, vocab_size=len(tok), seed=3,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draft = perturbed_copy(target, 0.02, seed=1)  # agrees often: multi-token accepts
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"target": str(root / "target"), "draft": str(root / "draft"), "data": str(data)}


def config(models, out: Path, **kw) -> ExtractConfig:
    # window = batch_size: the transformers engine then runs each window as one batch, the requests
    # the fake SGLang engine gets in one call, so fp32 rows can be compared bit for bit
    base = dict(model=models["target"], dataset=models["data"], output=str(out), id_field="id", dtype="float32",
                layers="final", max_new_tokens=10, batch_size=3, window=3, device="cpu", sglang_capture="lists")
    base.update(kw)
    return ExtractConfig(**base)


def assert_same_shards(a_dir: Path, b_dir: Path, speculative: bool = False, atol: float = 0.0,
                       rtol: float = 0.0) -> int:
    """Same samples, tokens and masks; rows bit-equal (``atol=rtol=0``) or ``|x - y| <= atol + rtol * |y|``."""
    a, b = hsx.open(a_dir), hsx.open(b_dir)
    assert a.sample_ids == b.sample_ids
    names = [g["name"] for g in a.metadata["layers"]]
    assert names == [g["name"] for g in b.metadata["layers"]]
    rows = 0
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids), x.sample_id
        assert x.prompt_len == y.prompt_len and x.finish_reason == y.finish_reason
        assert torch.equal(x.loss_mask, y.loss_mask)
        for n in names:
            if atol == rtol == 0:
                assert torch.equal(x.hidden(n), y.hidden(n)), (x.sample_id, n)  # fp32 bit-equality
            else:
                want, got = x.hidden(n), y.hidden(n)
                excess = (got - want).abs() - (atol + rtol * want.abs())
                assert excess.max().item() <= 0, (x.sample_id, n, (got - want).abs().max().item())
            rows += x.hidden(n).shape[0]
        if speculative == "counts":  # SGLang's lists: step counts only
            assert y.accept_lens is None and y.verify_steps == x.accept_lens.numel(), x.sample_id
        elif speculative:
            assert torch.equal(x.accept_lens, y.accept_lens) and y.accept_lens.dtype == torch.int16, x.sample_id
    return rows


# ---- good outputs: shards identical to the transformers engine's -----------------------------


@pytest.mark.parametrize("mode", ["generate", "prefill"])
def test_plain_shards_equal_transformers_engine(models, tmp_path, mode):
    extract(config(models, tmp_path / "hf", mode=mode), progress=False)
    summary = extract(config(models, tmp_path / "sgl", engine="sglang", mode=mode), progress=False)
    assert summary.samples == len(ROWS) and summary.errors == 0
    assert assert_same_shards(tmp_path / "hf", tmp_path / "sgl") > 0
    (engine,) = FakeEngine.instances
    args = engine.kwargs
    assert args["disable_radix_cache"] is True and args["chunked_prefill_size"] == -1
    assert args["enable_return_hidden_states"] is True and args["skip_tokenizer_init"] is True
    assert args["device"] == "cpu" and "speculative_algorithm" not in args
    assert all(isinstance(t, int) for prompt in engine.calls[0] for t in prompt)  # token ids in, not text
    meta = hsx.open(tmp_path / "sgl").metadata
    assert meta["engine"]["name"] == "sglang" and meta["engine"]["version"] == "0.5.23"
    assert meta["speculative"] is None


@pytest.mark.parametrize("topk,draft_tokens", [(1, 4), (2, 6)])
def test_eagle_shards_equal_transformers_engine(models, tmp_path, topk, draft_tokens):
    spec = dict(draft_model=models["draft"], spec_num_steps=3, spec_topk=topk, spec_num_draft_tokens=draft_tokens)
    hf = extract(config(models, tmp_path / "hf", **spec), progress=False)
    sgl = extract(config(models, tmp_path / "sgl", engine="sglang", spec_algorithm="EAGLE", **spec), progress=False)
    assert sgl.errors == 0
    assert assert_same_shards(tmp_path / "hf", tmp_path / "sgl", speculative="counts") > 0
    assert sgl.verify_steps == hf.verify_steps > 0
    assert hf.accepted > hf.verify_steps  # some steps accepted drafts
    args = FakeEngine.instances[0].kwargs
    assert (args["speculative_algorithm"], args["speculative_num_steps"], args["speculative_eagle_topk"],
            args["speculative_num_draft_tokens"], args["speculative_draft_model_path"]) == ("EAGLE", 3, topk, draft_tokens, models["draft"])
    meta = hsx.open(tmp_path / "sgl").metadata["speculative"]
    assert meta["algorithm"] == "EAGLE" and meta["topk"] == topk and meta["tree"] == (topk > 1)


def test_verify_accepts_step_counts_without_accept_lens(models, tmp_path):
    from hsx.shards.verify import verify

    spec = dict(draft_model=models["draft"], spec_num_steps=3, spec_topk=1, spec_num_draft_tokens=4)
    extract(config(models, tmp_path / "sgl", engine="sglang", spec_algorithm="EAGLE", **spec), progress=False)
    report = verify(tmp_path / "sgl")
    assert report.ok, report.faults


def test_aux_capture_translates_boundaries(models, tmp_path):
    """eagle3 boundaries [2, 4, 5] go to SGLang as ids [1, 3, 4]; rows equal the hf engine's eagle3 column."""
    extract(config(models, tmp_path / "hf", layers="eagle3"), progress=False)
    extract(config(models, tmp_path / "sgl", engine="sglang", layers="eagle3"), progress=False)
    assert assert_same_shards(tmp_path / "hf", tmp_path / "sgl") > 0
    args = FakeEngine.instances[0].kwargs
    assert args["enable_return_aux_hidden_states"] is True and args["speculative_algorithm"] == "EAGLE3"
    assert args["return_aux_hidden_state_layer_ids"] == [1, 3, 4]
    (g,) = hsx.open(tmp_path / "sgl").metadata["layers"]
    assert g["sources"] == [2, 4, 5] and "SGLang capture ids [1, 3, 4]" in g["rule"] and g["width"] == 3 * HIDDEN


def test_eagle3_speculative_rows_are_the_aux_concatenation(models, tmp_path):
    spec = dict(draft_model=models["draft"], spec_num_steps=2, spec_topk=1, spec_num_draft_tokens=3)
    extract(config(models, tmp_path / "hf", layers="eagle3", **spec), progress=False)
    extract(config(models, tmp_path / "sgl", engine="sglang", spec_algorithm="EAGLE3", layers="eagle3", **spec),
            progress=False)
    assert assert_same_shards(tmp_path / "hf", tmp_path / "sgl", speculative="counts") > 0
    with pytest.raises(HsxError, match="aux concatenation"):
        extract(config(models, tmp_path / "bad", engine="sglang", spec_algorithm="EAGLE3", **spec), progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algorithm,layers", [("EAGLE", "final"), ("EAGLE3", "eagle3")])
def test_adapter_shards_pass_the_recompute(models, tmp_path, dtype, algorithm, layers):
    """Rows that came through the adapter (nested lists, per-request slicing) pass ``verify --recompute``."""
    spec = dict(draft_model=models["draft"], spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6)
    extract(config(models, tmp_path / "sgl", engine="sglang", spec_algorithm=algorithm, layers=layers, dtype=dtype,
                   **spec), progress=False)
    report = recompute(tmp_path / "sgl", device="cpu", progress=False)
    assert report.ok, [f.message for f in report.findings][:5]
    assert len(report.samples) == len(ROWS) and report.rows > 0
    assert report.engine_compute_dtype == "auto"  # SGLang's own choice: the tolerance assumes bfloat16
    assert report.row_checks == report.rows * (3 if layers == "eagle3" else 1)


@pytest.mark.parametrize("fault,want", [("shift", "position p+1"), ("prenorm", f"boundary {NUM_LAYERS} (before the final norm)")])
def test_faults_in_adapter_shards_are_diagnosed(models, tmp_path, fault, want):
    spec = dict(draft_model=models["draft"], spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6)
    extract(config(models, tmp_path / "sgl", engine="sglang", spec_algorithm="EAGLE", **spec), progress=False)
    target = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()

    def edit(k, s, hidden):
        truth = oracle_sources(target, s.input_ids.long())
        if fault == "shift" and s.sample_id == "text-b":  # row p holds the state of p+1
            hidden["final"] = torch.cat([hidden["final"][1:], truth["final"][-1:]])
        elif fault == "prenorm":
            hidden["final"] = truth[NUM_LAYERS][: hidden["final"].shape[0]].clone()

    report = recompute(rewrite(tmp_path / "sgl", tmp_path / "bad", edit), device="cpu", progress=False)
    assert not report.ok
    assert {f.matched for f in report.findings} == {want}
    assert {f.sample_id for f in report.findings} == ({"text-b"} if fault == "shift" else {r["id"] for r in ROWS})


# ---- hazards ----------------------------------------------------------------------------------


def _errors(out: Path) -> dict[str, str]:
    return {e.sample_id: e.reason for e in load_manifest(out).errors}


def test_cached_prefill_rows_are_an_error_record(models, tmp_path):
    """A radix-cache hit returns only the uncached suffix of the prompt in hs[0]."""
    def hit(engine, call_no, i, out):
        if call_no == 0 and i == 1:
            out["meta_info"]["hidden_states"][0] = out["meta_info"]["hidden_states"][0][4:]
            out["meta_info"]["cached_tokens"] = 4
        return out

    FakeEngine.hazard = hit
    summary = extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and list(errors) == ["text-b"]
    assert "prompt rows" in errors["text-b"] and "cached or chunked" in errors["text-b"]
    assert "text-b" not in hsx.open(tmp_path / "sgl").sample_ids


def test_retracted_request_is_rerun_once(models, tmp_path):
    def retract_first_time(engine, call_no, i, out):
        if call_no == 0 and i == 2:
            hs = out["meta_info"]["hidden_states"]
            hs[2:2] = [hs[0]]  # what a retraction leaves: a second prefill block in the middle
            out["meta_info"]["num_retractions"] = 1
        return out

    FakeEngine.hazard = retract_first_time
    extract(config(models, tmp_path / "hf"), progress=False)
    summary = extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)
    assert summary.errors == 0
    calls = FakeEngine.instances[0].calls
    assert len(calls) == len(ROWS) // 3 + 2 and calls[1] == [calls[0][2]]  # the retracted prompt, alone
    # the rerun is a batch of one: fp32 batched vs unbatched differ by a few ulp, and an ulp grows with
    # the value (4.8e-7 at |x| ~ 4), so the bound is relative as well as absolute
    assert assert_same_shards(tmp_path / "hf", tmp_path / "sgl", atol=1e-6, rtol=1e-6) > 0


def test_always_retracted_request_is_an_error_record(models, tmp_path):
    def retract(engine, call_no, i, out):
        if engine.calls[call_no][i] == engine.calls[0][0]:
            out["meta_info"]["num_retractions"] = 1
        return out

    FakeEngine.hazard = retract
    summary = extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and summary.samples == len(ROWS) - 1
    assert "retracted" in errors["chat-a"]


def test_dropped_decode_row_is_an_error_record(models, tmp_path):
    def drop(engine, call_no, i, out):
        if i == 0 and call_no == 1:
            del out["meta_info"]["hidden_states"][3]
        return out

    FakeEngine.hazard = drop
    summary = extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and list(errors) == ["chat-d"]
    assert "hidden-state entries for completion_tokens 10" in errors["chat-d"]


@pytest.mark.parametrize("where", ["prefill", "decode", "all"])
def test_wrong_width_stops_the_run(models, tmp_path, where):
    def narrow(engine, call_no, i, out):
        hs = out["meta_info"]["hidden_states"]
        if where in ("prefill", "all"):
            hs[0] = [r[:-1] for r in hs[0]]
        if where in ("decode", "all"):
            hs[1] = hs[1] + [0.0]
        return out

    FakeEngine.hazard = narrow
    with pytest.raises(HsxError, match="declared width 64"):
        extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)


def test_missing_hidden_states_stop_the_run(models, tmp_path):
    def strip(engine, call_no, i, out):
        del out["meta_info"]["hidden_states"]
        return out

    FakeEngine.hazard = strip
    with pytest.raises(HsxError, match="no hidden states"):
        extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)


def test_aborted_request_is_an_error_record(models, tmp_path):
    def abort(engine, call_no, i, out):
        if i == 0 and call_no == 0:
            out["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory"}
        return out

    FakeEngine.hazard = abort
    summary = extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)
    assert summary.errors == 1 and "out of memory" in _errors(tmp_path / "sgl")["chat-a"]


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm,why", [("NGRAM", "rejected drafts"), ("STANDALONE", "empty"),
                                           ("DFLASH", "empty"), ("ngram", "rejected drafts"), ("NEXTN", "supports")])
def test_refused_algorithms(models, tmp_path, algorithm, why):
    with pytest.raises(HsxError, match=why):
        extract(config(models, tmp_path / "sgl", engine="sglang", spec_algorithm=algorithm,
                       draft_model=models["draft"]), progress=False)
    assert FakeEngine.instances == []


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23rc1", "0.4.9", "garbage"])
def test_old_sglang_refused(models, tmp_path, monkeypatch, version):
    monkeypatch.setitem(sys.modules, "sglang", fake_module(version))
    with pytest.raises(HsxError, match=r"hsx needs >= 0\.5\.23"):
        extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.6.1"])
def test_newer_sglang_accepted(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "sglang", fake_module(version))
    assert import_sglang().__version__ == version


def test_missing_sglang_is_a_clear_error(models, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    with pytest.raises(HsxError, match=r"pip install 'hsx\[sglang\]'"):
        extract(config(models, tmp_path / "sgl", engine="sglang"), progress=False)


@pytest.mark.parametrize("layers,why", [("final,eagle3", "one hidden-state column"), ("b8", "boundaries 1..7 are reachable"),
                                        ("0", "boundaries 1..7 are reachable")])
def test_unreachable_layers_refused(models, tmp_path, layers, why):
    with pytest.raises(HsxError, match=why):
        extract(config(models, tmp_path / "sgl", engine="sglang", layers=layers), progress=False)


@pytest.mark.parametrize("args,why", [({"disable_radix_cache": False}, "conflict with what hsx needs"),
                                      ({"chunked_prefill_size": 512}, "conflict with what hsx needs"),
                                      ({"device": "cuda"}, "config fields")])
def test_engine_args_cannot_undo_required_settings(models, tmp_path, args, why):
    with pytest.raises(HsxError, match=why):
        extract(config(models, tmp_path / "sgl", engine="sglang", engine_args=args), progress=False)


def test_engine_args_pass_through(models, tmp_path):
    extract(config(models, tmp_path / "sgl", engine="sglang",
                   engine_args={"tp_size": 1, "mem_fraction_static": 0.5, "attention_backend": "torch_native"}),
            progress=False)
    args = FakeEngine.instances[0].kwargs
    assert (args["tp_size"], args["mem_fraction_static"], args["attention_backend"]) == (1, 0.5, "torch_native")
    assert hsx.open(tmp_path / "sgl").metadata["engine"]["args"]["attention_backend"] == "torch_native"


def test_spec_options_need_an_algorithm(models, tmp_path):
    with pytest.raises(HsxError, match="--spec-algorithm EAGLE or EAGLE3"):
        extract(config(models, tmp_path / "sgl", engine="sglang", draft_model=models["draft"]), progress=False)
    with pytest.raises(HsxError, match="--engine sglang"):
        extract(config(models, tmp_path / "hf", spec_algorithm="EAGLE", draft_model=models["draft"]), progress=False)


def test_cli_spec_algorithm(models, tmp_path):
    from typer.testing import CliRunner

    from hsx.cli import app

    base = ["extract", "--model", models["target"], "--dataset", models["data"], "--id-field", "id", "--engine", "sglang",
            "--device", "cpu", "--max-new-tokens", "4", "--quiet"]
    bad = CliRunner().invoke(app, [*base, "-o", str(tmp_path / "bad"), "--spec-algorithm", "NGRAM",
                                   "--draft-model", models["draft"]])
    assert bad.exit_code != 0 and "NGRAM" in str(bad.exception)
    good = CliRunner().invoke(app, [*base, "-o", str(tmp_path / "good"), "--spec-algorithm", "EAGLE",
                                    "--draft-model", models["draft"], "--spec-num-steps", "2"])
    assert good.exit_code == 0, good.output
    assert FakeEngine.instances[-1].kwargs["speculative_algorithm"] == "EAGLE"


# ---- layer-id convention ----------------------------------------------------------------------


@pytest.mark.parametrize("model_type,ids,want", [
    ("llama", None, (2, 16, 29)),
    ("llama", [1, 15, 28], (2, 16, 29)),
    ("qwen3", [0, 15, 30], (1, 16, 31)),
    ("gpt_oss", [2, 16, 32], (2, 16, 32)),  # max id == L: already boundaries
    ("gpt_oss", [1, 15, 28], (2, 16, 29)),
    ("deepseek_v3", [1, 15, 28], (2, 16, 29)),  # first id 1: +1
    ("deepseek_v3", [2, 15, 28], (2, 15, 28)),  # otherwise as-is
])
def test_sglang_capture_rule(model_type, ids, want):
    assert sglang_boundaries(ids, model_type, 32) == want


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt_oss", "deepseek_v2"])
@pytest.mark.parametrize("boundaries", [(2, 16, 29), (2, 3, 4), (5,), (3, 31)])
def test_capture_ids_round_trip(model_type, boundaries):
    ids = sglang_ids_for(boundaries, model_type, 32)
    assert sglang_boundaries(ids, model_type, 32) == boundaries and all(0 <= i < 32 for i in ids)


@pytest.mark.parametrize("model_type,boundaries", [("llama", (0, 4)), ("llama", (4, 32)), ("llama", (5, 3)),
                                                   ("llama", (4, 4)), ("deepseek_v2", (1, 2, 3))])
def test_capture_ids_refused(model_type, boundaries):
    with pytest.raises(HsxError):
        sglang_ids_for(boundaries, model_type, 32)


# ---- hsx's capture (--sglang-capture tensors) ---------------------------------------------------


def tensors(models, out: Path, **kw) -> ExtractConfig:
    return config(models, out, engine="sglang", sglang_capture="tensors", **kw)


EAGLE_SPEC = dict(spec_num_steps=3, spec_topk=2, spec_num_draft_tokens=6)


@pytest.mark.parametrize("algorithm,layers", [(None, "final"), (None, "final,eagle3,b3"), ("EAGLE", "final"),
                                              ("EAGLE3", "final,eagle3"), ("EAGLE3", "eagle3,b2,final")])
def test_capture_shards_equal_transformers_engine(models, tmp_path, algorithm, layers):
    """Every column from one run, bit-equal to the hf engine's; accept lengths per step, int16."""
    spec = dict(draft_model=models["draft"], **EAGLE_SPEC) if algorithm else {}
    # under EAGLE3 SGLang captures what the draft config names (here nothing: its default [2, L//2, L-3] = 2, 4, 5)
    ids = None if algorithm == "EAGLE3" else [1, 3, 5]
    extract(config(models, tmp_path / "hf", layers=layers, eagle3_layer_ids=ids, **spec), progress=False)
    summary = extract(tensors(models, tmp_path / "sgl", layers=layers, eagle3_layer_ids=ids, spec_algorithm=algorithm,
                              **spec), progress=False)
    assert summary.errors == 0 and summary.samples == len(ROWS)
    assert assert_same_shards(tmp_path / "hf", tmp_path / "sgl", speculative=algorithm is not None) > 0
    (engine,) = FakeEngine.instances[-1:]
    assert engine.capture is not None
    assert list(Path(engine.capture.dir).iterdir()) == []  # every request's file read and removed
    meta = hsx.open(tmp_path / "sgl").metadata
    assert [g["name"] for g in meta["layers"]] == layers.split(",")
    assert meta["engine"]["capture"]["kind"] == "tensors"
    from hsx.shards.verify import verify

    report = verify(tmp_path / "sgl")
    assert report.ok, report.faults


def test_capture_plain_aux_ids_cover_every_column(models, tmp_path):
    """final,eagle3,b3 without speculation: one aux capture of boundaries 2, 3, 4, 6 (ids 1, 2, 3, 5)."""
    extract(tensors(models, tmp_path / "sgl", layers="final,eagle3,b3", eagle3_layer_ids=[1, 3, 5]), progress=False)
    args = FakeEngine.instances[0].kwargs
    assert args["return_aux_hidden_state_layer_ids"] == [1, 2, 3, 5] and args["enable_return_aux_hidden_states"]
    (hook,) = args["forward_hooks"]
    cols = {c["name"]: c["pieces"] for c in hook["config"]["columns"]}
    H = HIDDEN
    assert cols == {"final": [["last", 0, H]], "eagle3": [["hidden", 0, H], ["hidden", 2 * H, 4 * H]],
                    "b3": [["hidden", H, 2 * H]]}


def test_list_path_under_the_capture_stops_the_run(models, tmp_path):
    """An SGLang that never loaded the capture answers with float lists: hsx refuses them, it never converts."""
    FakeEngine.ignore_capture = True
    with pytest.raises(HsxError, match="float lists although hsx's capture is selected"):
        extract(tensors(models, tmp_path / "sgl"), progress=False)


def _rewrite(engine: FakeEngine, rid: str, edit) -> None:
    """Replace a request's capture file by ``edit(records)``, written back through the capture's Writer."""
    spec = engine.capture
    records = edit(read_records(spec, rid))
    spec.path(rid).unlink()
    writer = Writer(spec)
    for r in records:
        if r.kind == 2:
            writer.error(rid, r.message)
        else:
            writer.append(rid, r.kind, {k: v.clone() for k, v in r.rows.items()}, torch.from_numpy(r.tokens))


def _spec_run(models, tmp_path, **kw):
    return extract(tensors(models, tmp_path / "sgl", spec_algorithm="EAGLE", draft_model=models["draft"],
                           **EAGLE_SPEC, **kw), progress=False)


@pytest.mark.parametrize("lost", [1, 2, -1])
def test_capture_missing_step_is_an_error_record(models, tmp_path, lost):
    """A verify step's record lost (first, middle, last): a per-sample error, never rows shifted into place."""
    def drop(engine, call_no, i, out):
        if call_no == 0 and i == 1:
            _rewrite(engine, out["meta_info"]["id"], lambda rs: rs[:lost] + rs[lost + 1:] if lost != -1 else rs[:-1])
        return out

    FakeEngine.hazard = drop
    summary = _spec_run(models, tmp_path)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and list(errors) == ["text-b"]
    assert "a step's rows are missing" in errors["text-b"]
    assert "text-b" not in hsx.open(tmp_path / "sgl").sample_ids


def test_capture_step_count_differs_from_sglang_totals(models, tmp_path):
    def miscount(engine, call_no, i, out):
        if call_no == 0 and i == 0:
            out["meta_info"]["spec_verify_ct"] += 1
        return out

    FakeEngine.hazard = miscount
    summary = _spec_run(models, tmp_path)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and "spec_verify_ct" in errors["chat-a"]


def test_capture_retracted_request_is_rerun_once(models, tmp_path):
    """A retraction leaves a second prefill block in the request's file; the request runs again on its own."""
    def retract_first_time(engine, call_no, i, out):
        if call_no == 0 and i == 2:
            _rewrite(engine, out["meta_info"]["id"], lambda rs: rs[:2] + [rs[0]] + rs[2:])
            out["meta_info"]["num_retractions"] = 1
        return out

    FakeEngine.hazard = retract_first_time
    extract(config(models, tmp_path / "hf"), progress=False)
    summary = extract(tensors(models, tmp_path / "sgl"), progress=False)
    assert summary.errors == 0
    calls = FakeEngine.instances[0].calls
    assert calls[1] == [calls[0][2]]
    assert assert_same_shards(tmp_path / "hf", tmp_path / "sgl", atol=1e-6, rtol=1e-6) > 0


def test_capture_unreported_retraction_is_an_error_record(models, tmp_path):
    """A second prefill block without num_retractions is still caught, from the file alone."""
    def retract(engine, call_no, i, out):
        if call_no == 0 and i == 0:
            _rewrite(engine, out["meta_info"]["id"], lambda rs: rs[:3] + [rs[0]] + rs[3:])
        return out

    FakeEngine.hazard = retract
    summary = extract(tensors(models, tmp_path / "sgl"), progress=False)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and "prefill blocks at records [0, 3]" in errors["chat-a"]


def test_capture_always_retracted_request_is_an_error_record(models, tmp_path):
    def retract(engine, call_no, i, out):
        if engine.calls[call_no][i] == engine.calls[0][0]:
            out["meta_info"]["num_retractions"] = 1
        return out

    FakeEngine.hazard = retract
    summary = extract(tensors(models, tmp_path / "sgl"), progress=False)
    assert summary.errors == 1 and "retracted" in _errors(tmp_path / "sgl")["chat-a"]
    assert list(Path(FakeEngine.instances[0].capture.dir).iterdir()) == []  # both runs' files removed


def test_capture_aborted_request_is_an_error_record(models, tmp_path):
    def abort(engine, call_no, i, out):
        if call_no == 0 and i == 1:
            out["meta_info"]["finish_reason"] = {"type": "abort", "message": "client gone"}
            _rewrite(engine, out["meta_info"]["id"], lambda rs: rs[:2])  # an aborted request stops mid-run
        return out

    FakeEngine.hazard = abort
    summary = _spec_run(models, tmp_path)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and "abort" in errors["text-b"]
    assert list(Path(FakeEngine.instances[0].capture.dir).iterdir()) == []


def test_capture_scheduler_error_is_an_error_record(models, tmp_path):
    """Rows the scheduler could not cut (here: a source of the wrong width) are a per-sample error naming why."""
    def narrow(engine, call_no, i, out):
        if call_no == 0 and i == 0:
            rid = out["meta_info"]["id"]
            spec = engine.capture
            spec.path(rid).unlink()
            Writer(spec)._columns_or_errors([types.SimpleNamespace(rid=rid, return_hidden_states=True)],
                                            {"hidden": torch.zeros(3, HIDDEN + 1)}, "prefill")
        return out

    FakeEngine.hazard = narrow
    summary = extract(tensors(models, tmp_path / "sgl"), progress=False)
    errors = _errors(tmp_path / "sgl")
    assert summary.errors == 1 and f"expected [rows, {HIDDEN}]" in errors["chat-a"]


def test_capture_truncated_file_stops_the_run(models, tmp_path):
    def truncate(engine, call_no, i, out):
        if call_no == 0 and i == 0:
            path = engine.capture.path(out["meta_info"]["id"])
            path.write_bytes(path.read_bytes()[:-5])
        return out

    FakeEngine.hazard = truncate
    with pytest.raises(HsxError, match="truncated"):
        extract(tensors(models, tmp_path / "sgl"), progress=False)


def test_capture_refuses_untested_sglang(models, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", fake_module("0.5.24"))
    with pytest.raises(HsxError, match=r"checked on SGLang 0\.5\.23 only; SGLang 0\.5\.24 is installed"):
        extract(tensors(models, tmp_path / "sgl"), progress=False)
    extract(config(models, tmp_path / "lists", engine="sglang"), progress=False)  # the list path takes it


@pytest.mark.parametrize("layers,algorithm,why", [
    ("final,b3", "EAGLE", "only the final state"),
    ("final,eagle3,b3", "EAGLE3", r"captures boundaries \[2, 4, 5\] \(draft ids None\); .* also asks for \[3\]"),
])
def test_capture_unreachable_columns_refused(models, tmp_path, layers, algorithm, why):
    with pytest.raises(HsxError, match=why):
        extract(tensors(models, tmp_path / "sgl", layers=layers, spec_algorithm=algorithm, draft_model=models["draft"],
                        **EAGLE_SPEC), progress=False)


def test_capture_final_under_eagle3_refused_with_cuda_graphs(models, tmp_path):
    with pytest.raises(HsxError, match="disable_cuda_graph=true"):
        extract(tensors(models, tmp_path / "sgl", layers="final,eagle3", spec_algorithm="EAGLE3", device="cuda",
                        draft_model=models["draft"], **EAGLE_SPEC), progress=False)


def test_front_moves_the_accepted_tree_path():
    from hsx.engine.sglang.capture import front

    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(8, 3)  # batch 2, stride 4
    accept_index = torch.tensor([[0, 2, -1], [4, 7, 5]])
    out = front(x, accept_index, 2, 4)
    assert torch.equal(out[[0, 1]], x[[0, 2]]) and torch.equal(out[[4, 5, 6]], x[[4, 7, 5]])
    assert torch.equal(out[3], x[3]) and torch.equal(out[7], x[7])  # past the path: untouched
