"""Progress in tokens: what the transformers engine reports as its forwards finish, and the bar built on it.

The engine's reports add up exactly to the run's tokens (every prompt token once, chunk by chunk;
every kept completion token once, overshoot past a stop or the budget not counted; the completion
budget given back by requests that stop early), for both modes, both padding sides, chunked and
one-forward prefill, batches of one and several, plain and speculative decoding. The bar's text and
its ETA are checked on a clock the test sets, so nothing depends on timing.
"""

from __future__ import annotations

import pytest
import torch

from hsx.align import ModelShape, parse_layers
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.engine.hf import HFEngine, SamplingSettings, SpecSettings
from hsx.run import core
from hsx.run.core import Progress, RunSummary

torch.set_num_threads(1)
VOCAB, EOS = 96, 5
LENGTHS = [9, 3, 17, 1, 12]


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(num_layers=3, hidden_size=32, vocab_size=VOCAB, seed=4, eos_token_id=EOS).eval()


def requests(n: int) -> list:
    g = torch.Generator().manual_seed(n)
    return [(f"r{i}", torch.randint(6, VOCAB, (LENGTHS[i],), generator=g)) for i in range(n)]


class Reports:
    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, **counts) -> None:
        self.calls.append(counts)

    def total(self, key: str) -> int:
        return sum(c.get(key, 0) for c in self.calls)


def engine_for(target, draft: bool, side: str, chunk) -> HFEngine:
    groups = parse_layers("final", ModelShape.from_config(target.config))
    spec = SpecSettings(num_steps=2, topk=1, num_draft_tokens=3) if draft else None
    return HFEngine(target, groups, draft_model=make_layerskip_draft(target, 1) if draft else None, spec=spec,
                    store_dtype=torch.float32, padding_side=side, prefill_chunk=chunk)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("batch", [1, 5])
def test_prefill_reports_every_prompt_token_once_chunk_by_chunk(target, side, chunk, batch):
    engine = engine_for(target, False, side, chunk)
    engine.on_tokens = seen = Reports()
    reqs = requests(batch)
    engine.prefill(reqs)
    width = max(LENGTHS[:batch])
    assert len(seen.calls) == (1 if chunk is None else -(-width // chunk))  # one report a forward
    assert seen.total("prompt") == sum(LENGTHS[:batch])


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "chain"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("batch,slots", [(1, 1), (5, 2), (5, 5)])
@pytest.mark.parametrize("max_new", [1, 7])
def test_generation_reports_every_kept_token_once_and_gives_back_unused_budget(target, draft, side, chunk, batch,
                                                                               slots, max_new):
    engine = engine_for(target, draft, side, chunk)
    engine.on_tokens = seen = Reports()
    reqs = requests(batch)
    sampling = SamplingSettings(max_new_tokens=max_new, stop_token_ids=(EOS, 7, 11, 13))  # some stop early
    samples = dict(engine.stream(reqs, sampling, slots=slots))
    completion = sum(s.input_ids.numel() - s.prompt_len for s in samples.values())
    assert seen.total("prompt") == sum(LENGTHS[:batch])
    assert seen.total("generated") == completion
    # the budget given back is what the requests that stopped early did not use
    assert -seen.total("budget") == batch * max_new - completion


def test_a_runner_window_reports_its_prompt_tokens_and_budget(target, tmp_path):
    from hsx.config import ExtractConfig
    from hsx.demo.tokenizer import build_demo_tokenizer
    from hsx.engine.registry import build_engine
    from hsx.data.render import Prompt

    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=2, hidden_size=32, vocab_size=len(tok), seed=1, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    for mode in ("prefill", "generate"):
        cfg = ExtractConfig(model=str(tmp_path / "m"), dataset="d", output="o", mode=mode, max_new_tokens=4,
                            batch_size=2, dtype="float32")
        runner = build_engine(cfg)
        runner.watch_tokens(seen := Reports())
        prompts = [Prompt(f"s{i}", i, list(range(10, 10 + n)), [0] * n) for i, n in enumerate([6, 2, 9])]
        done = list(runner.stream(prompts))
        assert seen.calls[0] == {"queued": 17, "budget": 12 if mode == "generate" else 0}
        assert seen.total("prompt") == 17 and len(done) == 3
        if mode == "generate":
            assert seen.total("generated") == sum(s.input_ids.numel() - s.prompt_len for _, s in done)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bar_moves_with_tokens_and_its_eta_is_what_is_left_at_the_rates_so_far(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(core.time, "perf_counter", clock)
    bar = Progress(1, RunSummary("out"), enabled=False)
    bar.tokens(queued=4001, budget=128)  # one long prompt and its completion budget
    assert bar.eta() is None and "prompt 0/4,001 tok" in bar._postfix() and "eta ?" in bar._postfix()
    clock.now += 10.0
    bar.tokens(prompt=1000)  # a chunk in 10 s: 100 tok/s of prefill
    assert "prompt 1,000/4,001 tok" in bar._postfix()
    assert bar.eta() is None  # no generation rate yet: nothing honest to say about the budget
    clock.now += 30.0
    bar.tokens(prompt=3001)
    clock.now += 2.0
    bar.tokens(generated=1)  # the first token: 2 s
    clock.now += 2.0
    bar.tokens(generated=1)
    assert bar.counts == {"queued": 4001, "prompt": 4001, "generated": 2, "budget": 128}
    assert bar.eta() == pytest.approx(126 * 4.0 / 2)  # the budget left at the generation rate so far
    assert "generated 2/<=128 tok" in bar._postfix() and "eta 4:12" in bar._postfix()
    bar.tokens(budget=-100)  # the request stopped at 28 tokens: its unused budget comes back
    assert bar.eta() == pytest.approx(26 * 2.0)


def test_a_bar_without_token_reports_counts_samples_as_before(monkeypatch):
    bar = Progress(3, RunSummary("out"), enabled=False)
    assert bar._postfix().startswith("tok_s=") and bar.eta() == 0.0


def test_rows_a_resumed_run_skips_come_off_the_total_and_do_not_count_as_done(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(core.time, "perf_counter", clock)
    bar = Progress(1_000_000, RunSummary("out"))  # drawn (to the captured stderr): a disabled bar counts nothing
    bar.update(core.Resumed(600_000))  # skipped at once: not samples done at the rate of this run
    for _ in range(3):
        clock.now += 1.0
        bar.update(object())  # a record
    assert (bar.bar.n, bar.bar.total) == (3, 400_000)  # the bar's own rate and ETA see only this run's work
    assert bar._postfix().endswith("resumed 600,000")
