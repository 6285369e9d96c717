"""The online feed: the same records (bit for bit, same order) and the same EAGLE3 batches as the
shards of ``extract`` with the same config; failures as items, bounded run-ahead, early exit,
engine errors raised in the consumer; engines as Ray workers, equal to one process."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import hsx
from hsx.config import ExtractConfig
from hsx.run.core import Failure
from hsx.demo.models import build_tiny_llama, make_layerskip_draft
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.eagle3 import Eagle3Dataset, Eagle3Stream, collate, shift_for_draft
from hsx.errors import HsxError
from hsx.run.feed import Feed, in_source_order
from hsx.run.pipeline import extract
from hsx.shards.manifest import load_manifest
from hsx.shards.writer import Record

ROWS = [
    {"id": "a", "messages": [{"role": "user", "content": "How do tides work?"},
                             {"role": "assistant", "content": "The Moon pulls on the oceans."}]},
    {"id": "b", "text": "The river ran past the old mill and under the stone bridge."},
    {"id": "bad-turn", "messages": [{"role": "user"}]},
    {"id": "c", "messages": [{"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "Blue, like the sky on a clear day in June."}]},
    {"id": "a", "text": "A repeated id."},
    {"id": "d", "text": "Bread is made of flour, water, salt and yeast."},
    {"id": "e", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]},
    {"id": "f", "text": "word " * 30},
    {"id": "g", "text": "Short."},
]
NUM_GOOD = 7


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stream")
    tok = build_demo_tokenizer()
    target = build_tiny_llama(num_layers=4, hidden_size=64, vocab_size=len(tok), seed=5,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    draft = make_layerskip_draft(target, num_layers=2)
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"root": root, "target": str(root / "target"), "draft": str(root / "draft"), "data": str(data)}


def config(models, out: Path, **kw) -> ExtractConfig:
    base = dict(model=models["target"], dataset=models["data"], output=str(out), id_field="id", layers="final,eagle3,0",
                max_new_tokens=10, batch_size=2, window=4, max_shard_samples=3)
    base.update(kw)
    return ExtractConfig(**base)


RUNS = {
    "prefill": dict(mode="prefill"),
    "generate": dict(mode="generate"),
    "chain": dict(mode="generate", spec_num_steps=3, spec_topk=1, spec_num_draft_tokens=4),
    "tree-float32-keep": dict(mode="generate", spec_num_steps=2, spec_topk=2, spec_num_draft_tokens=4,
                              dtype="float32", keep="completion"),
}


def spec(models, kw: dict) -> dict:
    return {**kw, "draft_model": models["draft"]} if "spec_topk" in kw else kw


@pytest.mark.parametrize("run", sorted(RUNS))
def test_stream_equals_extract_shards(models, tmp_path, run):
    cfg = config(models, tmp_path / "out", **spec(models, RUNS[run]))
    summary = extract(cfg, progress=False)
    shards = hsx.open(tmp_path / "out")
    feed = hsx.stream(cfg, ahead=3)
    items = list(feed)
    assert feed.metadata == shards.metadata
    records = [i for i in items if isinstance(i, Record)]
    assert [r.sample_id for r in records] == [s.sample_id for s in shards] and len(records) == NUM_GOOD
    for r, s in zip(records, shards):
        assert torch.equal(r.input_ids, s.input_ids.to(r.input_ids.dtype)), r.sample_id
        assert torch.equal(r.loss_mask, s.loss_mask.to(r.loss_mask.dtype)), r.sample_id
        assert (r.prompt_len, r.finish_reason, r.source_index) == (s.prompt_len, s.finish_reason, s.source_index)
        for g in shards.metadata["layers"]:
            got, want = r.hidden[g["name"]], s.hidden(g["name"])
            assert got.dtype == want.dtype and got.shape == want.shape, (r.sample_id, g["name"])
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), (r.sample_id, g["name"])
    # failures: one per error record, in source order, the same reasons; nothing raised
    errors = load_manifest(tmp_path / "out").errors
    failures = [i for i in items if isinstance(i, Failure)]
    assert [(f.sample_id, f.source_index, f.reason) for f in failures] == \
        [(e.sample_id, e.source_index, e.reason) for e in errors] and len(failures) == 2
    assert [i.source_index for i in items] == list(range(len(ROWS)))
    assert feed.failures == failures
    for name in ("samples", "errors", "tokens", "completion_tokens", "rows", "verify_steps", "accepted"):
        assert getattr(feed.summary, name) == getattr(summary, name), name


@pytest.mark.parametrize("mode", ["prefill", "generate"])
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle3_batches_equal_offline(models, tmp_path, mode, batch):
    cfg = config(models, tmp_path / "out", mode=mode, layers="final,eagle3")
    extract(cfg, progress=False)
    offline = torch.utils.data.DataLoader(Eagle3Dataset(tmp_path / "out", max_len=12), batch_size=batch,
                                          collate_fn=collate)
    stream = Eagle3Stream(cfg, max_len=12, ahead=2)
    online = torch.utils.data.DataLoader(stream, batch_size=batch, collate_fn=collate)
    pairs = list(zip(offline, online, strict=True))
    assert len(pairs) == -(-NUM_GOOD // batch) and len(stream.failures) == 2
    for want, got in pairs:
        assert want["sample_ids"] == got["sample_ids"]
        for key in ("input_ids", "loss_mask", "attention_mask", "aux_hidden_state", "hidden_state", "lengths"):
            assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
        for key, value in shift_for_draft(want).items():
            assert torch.equal(value, shift_for_draft(got)[key]), key


def test_engine_runs_at_most_ahead(models, tmp_path, monkeypatch):
    """A slow consumer holds the engine back: produced - consumed stays within the queue, the
    reorder window and the one item in the producer's hand."""
    rows = [{"id": f"r{i}", "text": "word " * (1 + i % 5)} for i in range(24)]
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(models, tmp_path / "unused", dataset=str(data), mode="prefill", window=2, batch_size=2)
    feed = Feed(cfg, ahead=2)
    produced = []
    stream = feed.engine.stream

    def counting(prompts):
        for pair in stream(prompts):
            produced.append(pair[0].sample_id)
            yield pair

    monkeypatch.setattr(feed.engine, "stream", counting)
    gaps = []
    for consumed, _ in enumerate(feed, start=1):
        time.sleep(0.02)
        gaps.append(len(produced) - consumed)
    assert consumed == len(rows) == len(produced)
    assert max(gaps) <= 2 + cfg.window_rows + 1, gaps


def test_early_exit_stops_the_engine_thread(models, tmp_path):
    feed = Feed(config(models, tmp_path / "unused", mode="prefill"), ahead=1)
    before = {t.ident for t in threading.enumerate()}
    it = iter(feed)
    first = next(it)
    assert first.source_index == 0
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "hsx-feed" and t.ident not in before]
    assert len([i for i in feed]) == len(ROWS)  # a new pass runs the whole dataset again


def test_engine_error_raised_in_consumer(models, tmp_path, monkeypatch):
    feed = Feed(config(models, tmp_path / "unused", mode="prefill"))

    def broken(prompts):
        raise RuntimeError("engine fell over")
        yield

    monkeypatch.setattr(feed.engine, "stream", broken)
    with pytest.raises(RuntimeError, match="engine fell over"):
        list(feed)


def test_refusals(models, tmp_path):
    with pytest.raises(HsxError, match="ahead"):
        Feed(config(models, tmp_path / "o"), ahead=0)
    with pytest.raises(HsxError, match="eagle3"):
        Eagle3Stream(config(models, tmp_path / "o", layers="final"))
    Feed(config(models, ""))  # no output needed


def test_in_source_order():
    items = [Failure(str(i), i, "") for i in (1, 0, 3, 2, 5, 4)]
    assert [i.source_index for i in in_source_order(items)] == [0, 1, 2, 3, 4, 5]


@pytest.mark.slow
def test_ray_workers_feed_the_same_records(models, tmp_path):
    """Two engine workers on a local Ray (half a CPU each, so one compute thread like the
    reference below) give the records and failures of one process, in the same order."""
    pytest.importorskip("ray")
    cfg = config(models, "", mode="generate", dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = list(Feed(cfg))
    finally:
        torch.set_num_threads(threads)
    ray_cfg = config(models, "", mode="generate", dtype="float32", ray=True, num_workers=2, cpus_per_worker=0.5,
                     unit_size=4)
    with Feed(ray_cfg, ahead=1) as feed:
        assert feed.engine is None and feed.metadata["layers"] == Feed(cfg).metadata["layers"]
        for _ in range(2):  # a second pass reuses the workers
            got = list(feed)
            assert [type(i) for i in got] == [type(i) for i in want]
            for g, w in zip(got, want):
                if isinstance(w, Failure):
                    assert g == w
                    continue
                assert (g.sample_id, g.source_index, g.prompt_len, g.finish_reason) == \
                    (w.sample_id, w.source_index, w.prompt_len, w.finish_reason)
                assert torch.equal(g.input_ids, w.input_ids) and torch.equal(g.loss_mask, w.loss_mask)
                for name, h in w.hidden.items():
                    assert g.hidden[name].dtype == h.dtype and torch.equal(g.hidden[name], h), (g.sample_id, name)
        assert feed.summary.samples == NUM_GOOD and feed.summary.errors == 2
        it = iter(feed)
        assert [next(it).source_index for _ in range(2)] == [0, 1]
        it.close()  # a pass stopped early: its running units are let go, the next pass starts afresh
        assert [i.source_index for i in feed] == list(range(len(ROWS)))


def test_dataloader_workers_refused(models, tmp_path):
    stream = Eagle3Stream(config(models, "", mode="prefill", layers="final,eagle3"))
    loader = torch.utils.data.DataLoader(stream, batch_size=2, collate_fn=collate, num_workers=1)
    with pytest.raises(HsxError, match="num_workers=0"):
        next(iter(loader))


def test_engine_giving_up_on_a_sample_is_a_failure(models, tmp_path, monkeypatch):
    from hsx.errors import SampleError

    feed = Feed(config(models, "", mode="prefill"))
    stream = feed.engine.stream

    def gives_up_on_c(prompts):
        for prompt, sample in stream(prompts):
            yield prompt, SampleError(prompt.sample_id, "retracted twice") if prompt.sample_id == "c" else sample

    monkeypatch.setattr(feed.engine, "stream", gives_up_on_c)
    items = list(feed)
    assert [i.source_index for i in items] == list(range(len(ROWS)))
    assert [(f.sample_id, f.reason) for f in feed.failures if f.sample_id == "c"] == [("c", "retracted twice")]
    assert feed.summary.samples == NUM_GOOD - 1 and feed.summary.errors == 3


def load_script(name: str):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_online_equals_training_from_shards(models, tmp_path):
    cfg = config(models, tmp_path / "out", mode="generate", layers="final,eagle3")
    extract(cfg, progress=False)
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps(cfg.to_dict()))
    demo = load_script("train_eagle3_demo")
    kw = dict(steps=8, batch=2, held_out=0.3, log_every=0, threads=1)
    offline = demo.run_in_order(str(tmp_path / "out"), False, **kw)
    online = demo.run_in_order(str(run_file), True, ahead=2, **kw)
    assert offline["samples"] == online["samples"] and offline["samples"]["held_out"] > 0
    assert len(online["losses"]) == 8 and online["losses"] == offline["losses"]
    assert online["held_out_top1"] == offline["held_out_top1"]
    assert online["stream"]["failures"] == 2


def test_bench_stream_runs(models, tmp_path):
    cfg = config(models, "", mode="prefill")
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "bench.json"
    result = load_script("bench_stream").main(["--config", str(run_file), "--repeats", "1", "--warmup", "0",
                                               "--out", str(out)])
    assert json.loads(out.read_text()) == result and len(result["runs"]) == 1
    assert result["ratio_median"] > 0 and result["cpu_ratio_median"] > 0 and result["runs"][0]["tokens"] > 0


def _busy_stream_workers() -> list[int]:
    """Processes under this one running a feed unit (Ray names an actor's process by its method)."""
    import os

    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                kids.setdefault(int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [os.getpid()]
    while todo:
        for c in kids.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    busy = []
    for pid in found:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:
            continue
        if title == "ray::ExtractWorker.stream_unit":
            busy.append(pid)
    return busy


@pytest.mark.slow
def test_ray_worker_killed_mid_unit(models, tmp_path):
    """A worker SIGKILLed while it runs a unit: the unit runs again on a worker, and the feed still
    gives every record once, as one process does."""
    import os
    import signal

    pytest.importorskip("ray")
    rows = [{"id": f"r{i}", "text": f"Row {i}: " + "the mill and the river " * (i % 4) + "end."} for i in range(40)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(models, "", dataset=str(data), mode="generate", dtype="float32", layers="final")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [(r.sample_id, r.hidden["final"]) for r in Feed(cfg).records()]
    finally:
        torch.set_num_threads(threads)
    ray_cfg = config(models, "", dataset=str(data), mode="generate", dtype="float32", layers="final", ray=True,
                     num_workers=2, cpus_per_worker=0.5, unit_size=4)
    victim = None
    got = []
    with Feed(ray_cfg, ahead=1) as feed:
        for record in feed.records():
            got.append((record.sample_id, record.hidden["final"]))
            deadline = time.monotonic() + 60
            while victim is None and len(got) >= 4 and time.monotonic() < deadline:
                busy = _busy_stream_workers()
                if busy:
                    victim = busy[0]
                    os.kill(victim, signal.SIGKILL)
                time.sleep(0.01)
        retried = feed.source.retried
    assert victim is not None, "no worker was caught running a unit"
    assert retried >= 1, "the killed worker's unit was not run again"
    assert [sid for sid, _ in got] == [sid for sid, _ in want]
    for (sid, g), (_, w) in zip(got, want):
        assert torch.equal(g, w), sid
