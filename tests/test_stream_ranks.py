"""A feed shared by trainer ranks: two ranks run by torchrun (gloo, CPU) pull from one pool of two
engine workers on a local Ray. Their shares are disjoint and together the shards of ``extract`` bit
for bit; drop and pad give equal counts; a DDP probe trained on two ranks has the loss curve of one
process on the same global batches; a rank that stops early, or is SIGKILLed, ends the pass on the
other with an error naming it. Run as a script, this file is the ranks' program."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hsx
from hsx.config import ExtractConfig
from hsx.run.core import Failure
from hsx.errors import HsxError
from hsx.run.feed import Padding, Share, ranks_from

NUM_ROWS = 47
BAD = {5: {"id": "r5", "text": "   "}}  # an empty text: a failure
DUP = {30: "r3"}  # row 30 repeats row 3's id: a failure, decided in row 3's unit
NUM_RECORDS = NUM_ROWS - len(BAD) - len(DUP)  # 45: odd, so two ranks have a remainder
HIDDEN, BATCH, LR, SEED = 64, 2, 0.5, 7
HANG_GUARD = 600  # seconds: only a guard against a hang, never what a test asserts
STALL_TIMEOUT = 20  # seconds: the rank_timeout of the stall scenario (both ranks have joined before it counts)


def _rows() -> list[dict]:
    rows = []
    for i in range(NUM_ROWS):
        row = {"id": DUP.get(i, f"r{i}"), "text": f"Row {i}: " + "the mill and the river " * (i % 5) + "end."}
        rows.append(BAD.get(i, row))
    return rows


def config(setup: dict, **kw) -> ExtractConfig:
    base = dict(model=setup["model"], dataset=setup["data"], output="", id_field="id", dtype="float32", mode="prefill",
                layers="final,2", batch_size=2, window=4, max_shard_samples=8)
    return ExtractConfig(**{**base, **kw})


def shared(setup: dict, address: str) -> ExtractConfig:
    return config(setup, ray=True, ray_address=address, num_workers=2, cpus_per_worker=0.5, unit_size=4)


# --- the ranks' program (python -m torch.distributed.run ... tests/test_stream_ranks.py SCENARIO RUN.json OUT)

def probe_loss(probe, records: list) -> torch.Tensor:
    """Mean over samples of each sample's next-token cross-entropy from its final rows (prefill: one row a token)."""
    losses = [torch.nn.functional.cross_entropy(probe(r.hidden["final"][:-1]), r.input_ids[1:].long()) for r in records]
    return torch.stack(losses).mean()


def new_probe(vocab: int) -> torch.nn.Linear:
    torch.manual_seed(SEED)
    return torch.nn.Linear(HIDDEN, vocab)


def write_items(out: Path, name: str, items: list) -> None:
    """Items as JSON (fields) and safetensors (tensors): nothing here is read back through pickle."""
    from safetensors.torch import save_file

    rows, tensors = [], {}
    for k, item in enumerate(items):
        if isinstance(item, Failure):
            rows.append({"kind": "failure", "sample_id": item.sample_id, "source_index": item.source_index,
                         "reason": item.reason})
            continue
        rows.append({"kind": "padding" if isinstance(item, Padding) else "record", "sample_id": item.sample_id,
                     "source_index": item.source_index, "prompt_len": item.prompt_len,
                     "finish_reason": item.finish_reason})
        tensors[f"{k}/input_ids"], tensors[f"{k}/loss_mask"] = item.input_ids.contiguous(), item.loss_mask.contiguous()
        for col, h in item.hidden.items():
            tensors[f"{k}/hidden/{col}"] = h.contiguous()
    (out / f"{name}.json").write_text(json.dumps(rows))
    save_file(tensors, str(out / f"{name}.safetensors"))


def ranks_main(scenario: str, run_file: str, out_dir: str, vocab: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir)
    rank, world = ranks_from()  # from torchrun's RANK and WORLD_SIZE, as the feed takes them
    result: dict = {"rank": rank, "world": world, "pid": os.getpid()}
    dist.init_process_group("gloo")
    if scenario == "eagle3":
        eagle3_main(rank, run_file, out)
        dist.destroy_process_group()
        return
    feed = hsx.stream(run_file, ahead=2, rank_timeout=STALL_TIMEOUT if scenario == "stall" else HANG_GUARD)
    dist.barrier()  # both ranks have joined the pool: from here a wait is the pass's, not a start-up's
    try:
        if scenario == "stall":  # rank 1 stays alive but stops taking: rank 0 gives up after rank_timeout
            got = 0
            try:
                for _ in feed:
                    got += 1
                    if rank == 1 and got == 2:
                        result["stalled_at"] = got
                        deadline = time.monotonic() + HANG_GUARD
                        while not (out / "rank0.json").exists() and time.monotonic() < deadline:
                            time.sleep(0.2)  # until rank 0 has given up and said so
            except HsxError as e:
                result["error"] = str(e)
            result["items"] = got
            (out / f"rank{rank}.json").write_text(json.dumps(result))
            dist.barrier()  # rank 0 keeps the pool until rank 1 has heard why the pass ended
        elif scenario == "main":
            for p, remainder in enumerate(["keep", "drop", "pad"]):
                feed.remainder = remainder
                items = []
                for item in feed:
                    items.append(item)
                    if rank == 1 and p == 0:
                        time.sleep(0.02)  # a slow rank: the pool holds the faster one back
                write_items(out, f"rank{rank}-pass{p}", items)
                result[remainder] = {"records": feed.share.records, "dropped": feed.share.dropped,
                                     "padded": feed.share.padded, "samples": feed.summary.samples}
            feed.remainder = "drop"
            probe = torch.nn.parallel.DistributedDataParallel(new_probe(vocab))
            optim = torch.optim.SGD(probe.parameters(), lr=LR)
            losses, batch = [], []
            for record in feed.records():
                batch.append(record)
                if len(batch) < BATCH:
                    continue
                loss = probe_loss(probe, batch)
                optim.zero_grad()
                loss.backward()  # DDP averages the ranks' gradients: the gradient of the global batch's mean
                optim.step()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(float(total) / world)
                batch = []
            result["losses"], result["left_over"] = losses, len(batch)
            if rank == 0:
                result["stats"] = feed.source.stats()
        elif scenario == "standalone":  # no Ray named or running: rank 0 starts its own
            write_items(out, f"rank{rank}-pass0", list(feed))
        elif scenario.startswith("stop-then-kill-"):
            victim = int(scenario.rsplit("-", 1)[1])
            got = 0
            try:  # pass 0: rank 1 stops after 3 items; rank 0 cannot finish without it
                for _ in feed:
                    got += 1
                    if rank == 1 and got == 3:
                        break
            except HsxError as e:
                result["early"] = str(e)
            result["early_items"] = got
            got = 0
            try:  # pass 1: the victim stops taking and is killed; the other is held back, then told
                for _ in feed:
                    got += 1
                    if rank == victim and got == 3:
                        (out / "paused.json").write_text(json.dumps({"pid": os.getpid()}))
                        time.sleep(HANG_GUARD)
            except HsxError as e:
                result["killed"] = str(e)
            result["killed_items"] = got
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        feed.close()
    dist.destroy_process_group()


def eagle3_main(rank: int, run_file: str, out: Path) -> None:
    """One pass of an Eagle3Stream on this rank (padded to equal counts), its samples written out."""
    from safetensors.torch import save_file

    from hsx.eagle3 import Eagle3Stream

    stream = Eagle3Stream(run_file, remainder="pad", rank_timeout=HANG_GUARD)
    try:
        samples = list(stream)
    finally:
        stream.feed.close()
    save_file({f"{k}/{key}": v.contiguous() for k, s in enumerate(samples) for key, v in s.items()
               if isinstance(v, torch.Tensor)}, str(out / f"eagle3-rank{rank}.safetensors"))
    (out / f"eagle3-rank{rank}.json").write_text(json.dumps([{"sample_id": s["sample_id"], "padding": s.get("padding", False)}
                                                             for s in samples]))


if __name__ == "__main__":
    ranks_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    sys.exit(0)


# --- the tests

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer

    root = tmp_path_factory.mktemp("ranks")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=4, hidden_size=HIDDEN, vocab_size=len(tok), seed=3,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return {"root": root, "model": str(root / "target"), "data": str(data), "vocab": len(tok)}


@pytest.fixture(scope="module")
def shards(setup) -> list:
    """The offline run, with the one compute thread a Ray worker of half a CPU gets."""
    from hsx.run.pipeline import extract

    out = setup["root"] / "shards"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = extract(config(setup, output=str(out)), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert summary.samples == NUM_RECORDS and summary.errors == len(BAD) + len(DUP)
    return hsx.open(out)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs; the ranks join it at its address."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def torchrun(setup, address: str, scenario: str, out: Path, monitor_interval: float = 0.5,
             cfg: ExtractConfig | None = None, env: dict | None = None) -> subprocess.Popen:
    run_file = out / "run.json"
    run_file.write_text(json.dumps((cfg or shared(setup, address)).to_dict()))
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "0", "--monitor-interval", str(monitor_interval), __file__, scenario, str(run_file), str(out),
           str(setup["vocab"])]
    return subprocess.Popen(cmd, env=env, stdout=(out / "torchrun.log").open("w"), stderr=subprocess.STDOUT)


def run_to_end(proc: subprocess.Popen, out: Path) -> None:
    """Wait for a torchrun started by :func:`torchrun`; both ranks must exit cleanly."""
    try:
        code = proc.wait(timeout=HANG_GUARD)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert code == 0, (out / "torchrun.log").read_text()[-4000:]


def read_items(out: Path, name: str) -> list:
    from safetensors.torch import load_file

    rows = json.loads((out / f"{name}.json").read_text())
    tensors = load_file(str(out / f"{name}.safetensors"))
    items = []
    for k, row in enumerate(rows):
        if row["kind"] != "failure":
            row["input_ids"], row["loss_mask"] = tensors[f"{k}/input_ids"], tensors[f"{k}/loss_mask"]
            row["hidden"] = {key.split("/")[2]: t for key, t in tensors.items() if key.startswith(f"{k}/hidden/")}
        items.append(SimpleNamespace(**row))
    return items


@pytest.fixture(scope="module")
def main_run(setup, cluster, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("main-run")
    run_to_end(torchrun(setup, cluster, "main", out), out)
    return out


def assert_same(got, want) -> None:
    assert (got.sample_id, got.source_index, got.prompt_len, got.finish_reason) == \
        (want.sample_id, want.source_index, want.prompt_len, want.finish_reason)
    assert torch.equal(got.input_ids, want.input_ids.to(got.input_ids.dtype)), got.sample_id
    assert torch.equal(got.loss_mask, want.loss_mask.to(got.loss_mask.dtype)), got.sample_id
    assert sorted(got.hidden) == ["b2", "final"]  # the boundary after block 2, and the final norm's output
    for name, h in got.hidden.items():
        assert torch.equal(h.view(torch.int32), want.hidden(name).contiguous().view(torch.int32)), (got.sample_id, name)


@pytest.mark.slow
def test_shares_are_disjoint_and_together_the_shards(main_run, shards):
    offline = list(shards)
    shares = [read_items(main_run, f"rank{r}-pass0") for r in range(2)]
    records = [[i for i in s if i.kind == "record"] for s in shares]
    assert not {i.sample_id for i in records[0]} & {i.sample_id for i in records[1]}
    # record k of the run on rank k mod 2, in source order; together every record once, bit for bit
    for r in range(2):
        assert [i.sample_id for i in records[r]] == [s.sample_id for s in offline[r::2]]
        for got, want in zip(records[r], offline[r::2]):
            assert_same(got, want)
    assert len(records[0]) + len(records[1]) == len(offline) == NUM_RECORDS
    # failures on rank source_index mod 2, together the error records of extract
    failures = [(i.sample_id, i.source_index, i.reason) for s in shares for i in s if i.kind == "failure"]
    assert sorted(failures) == sorted((e.sample_id, e.source_index, e.reason) for e in shards.errors)
    assert all(i.source_index % 2 == r for r in range(2) for i in shares[r] if i.kind == "failure")
    for r in range(2):
        result = json.loads((main_run / f"rank{r}.json").read_text())
        assert result["keep"]["records"] == NUM_RECORDS and result["keep"]["samples"] == len(records[r])


@pytest.mark.slow
def test_drop_and_pad_give_every_rank_the_same_count(main_run, shards):
    offline = list(shards)
    drop = [read_items(main_run, f"rank{r}-pass1") for r in range(2)]
    pad = [read_items(main_run, f"rank{r}-pass2") for r in range(2)]
    dropped = [[i for i in s if i.kind != "failure"] for s in drop]
    padded = [[i for i in s if i.kind != "failure"] for s in pad]
    assert [len(s) for s in dropped] == [NUM_RECORDS // 2] * 2  # the last record goes to no rank
    assert sorted(i.sample_id for s in dropped for i in s) == sorted(s.sample_id for s in offline[:-1])
    assert [len(s) for s in padded] == [NUM_RECORDS // 2 + 1] * 2
    assert [i.kind for i in padded[0]] == ["record"] * len(padded[0])
    assert [i.kind for i in padded[1]] == ["record"] * (len(padded[1]) - 1) + ["padding"]
    assert_same(padded[1][-1], offline[0])  # the short rank repeats the pass's first record
    for r in range(2):  # every pass gives the same shares
        assert [i.sample_id for i in padded[r] if i.kind == "record"] == [s.sample_id for s in offline[r::2]]
        result = json.loads((main_run / f"rank{r}.json").read_text())
        assert result["drop"]["dropped"] == 1 and result["pad"]["padded"] == r
        assert result["pad"]["samples"] == NUM_RECORDS // 2 + 1 - r  # padding is not counted as a sample


@pytest.mark.slow
def test_ddp_on_two_ranks_has_the_loss_curve_of_one_process(main_run, shards, setup):
    results = [json.loads((main_run / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["losses"] == results[1]["losses"]  # all-reduced
    torch.set_num_threads(1)
    probe = new_probe(setup["vocab"])
    optim = torch.optim.SGD(probe.parameters(), lr=LR)
    records = list(shards)[: NUM_RECORDS - NUM_RECORDS % 2]  # drop: the global batches of both ranks together
    global_batch = 2 * BATCH
    want = []
    for s in range(len(records) // global_batch):
        batch = [SimpleNamespace(hidden={"final": r.hidden("final")}, input_ids=r.input_ids)
                 for r in records[s * global_batch:(s + 1) * global_batch]]
        loss = probe_loss(probe, batch)
        optim.zero_grad()
        loss.backward()
        optim.step()
        want.append(float(loss.detach()))
    assert len(results[0]["losses"]) == len(want) == (NUM_RECORDS // 2) // BATCH
    assert want[-1] < want[0]  # it learns something
    assert results[0]["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_the_pool_holds_the_faster_rank_back(main_run):
    stats = json.loads((main_run / "rank0.json").read_text())["stats"]
    assert stats["units"] == -(-NUM_ROWS // 4) and stats["retried"] == 0
    assert 0 < stats["max_in_flight"] <= stats["limit"] == 2 + 1  # workers + ceil(ahead / unit rows)


KILLED = {1: "rank 1 is gone (in pass 1",  # seen by the pool through rank 1's lease
          0: "rank 0, whose job holds it, stopped or died"}  # the pool ended with rank 0's job


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_stops_or_dies_ends_the_pass_on_the_other(setup, cluster, tmp_path, victim):
    # a long monitor interval keeps torchrun's agent from stopping the survivor itself once the
    # victim dies: what the survivor sees is the feed's own doing
    survivor = 1 - victim
    proc = torchrun(setup, cluster, f"stop-then-kill-{victim}", tmp_path, monitor_interval=HANG_GUARD)
    try:
        deadline = time.monotonic() + HANG_GUARD
        while not (tmp_path / "paused.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[-4000:]
            time.sleep(0.2)
        pid = json.loads((tmp_path / "paused.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)  # a worker of the torchrun this test started
        while not (tmp_path / f"rank{survivor}.json").exists():
            assert time.monotonic() < deadline, f"rank {survivor} hangs after rank {victim} was killed"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = json.loads((tmp_path / f"rank{survivor}.json").read_text())
    if survivor == 0:
        assert "rank 1 stopped its pass early in pass 0" in result["early"]
        assert result["early_items"] < -(-NUM_RECORDS // 2) + 1  # held back: not its whole share
    print(f"rank {victim} killed; rank {survivor} got: {result['killed']}")
    assert KILLED[victim] in result["killed"], result["killed"]
    assert result["killed_items"] < NUM_RECORDS // 2  # held back by the pool, not run to the end


@pytest.mark.slow
def test_a_stalled_rank_ends_the_pass_after_rank_timeout(setup, cluster, tmp_path):
    run_to_end(torchrun(setup, cluster, "stall", tmp_path), tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    print(f"rank 0 got: {r0['error']}\nrank 1, once it took again, got: {r1['error']}")
    assert f"rank 0: waited {STALL_TIMEOUT} s in pass 0 for rank(s) [1], which took nothing" in r0["error"]
    assert r0["items"] < -(-NUM_RECORDS // 2)  # held back by the stalled rank: not its whole share
    assert r1["stalled_at"] == 2 and r1["items"] < -(-NUM_RECORDS // 2)  # then what its units held, no more
    assert f"rank 0 waited {STALL_TIMEOUT} s for rank(s) [1], which took nothing, in pass 0" in r1["error"]


@pytest.mark.slow
def test_an_eagle3_stream_on_two_ranks_is_the_offline_dataset_shared(setup, cluster, tmp_path):
    from safetensors.torch import load_file

    from hsx.demo.models import build_tiny_llama
    from hsx.demo.tokenizer import build_demo_tokenizer
    from hsx.eagle3 import Eagle3Dataset
    from hsx.run.pipeline import extract

    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=8, hidden_size=HIDDEN, vocab_size=len(tok), seed=5,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp_path / "target8")
    tok.save_pretrained(tmp_path / "target8")
    eagle3 = dict(model=str(tmp_path / "target8"), layers="final,eagle3")
    cfg = config(setup, **eagle3, ray=True, ray_address=cluster, num_workers=2, cpus_per_worker=0.5, unit_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the one compute thread a Ray worker of half a CPU gets
    try:
        extract(config(setup, **eagle3, output=str(tmp_path / "offline")), progress=False)
    finally:
        torch.set_num_threads(threads)
    offline = Eagle3Dataset(tmp_path / "offline")
    assert len(offline) == NUM_RECORDS
    run_to_end(torchrun(setup, cluster, "eagle3", tmp_path, cfg=cfg), tmp_path)
    for r in range(2):
        listed = json.loads((tmp_path / f"eagle3-rank{r}.json").read_text())
        tensors = load_file(str(tmp_path / f"eagle3-rank{r}.safetensors"))
        assert len(listed) == NUM_RECORDS // 2 + 1  # padded: both ranks take the same number of steps
        want = list(range(r, NUM_RECORDS, 2)) + ([0] if r == 1 else [])  # the short rank repeats sample 0
        assert [x["padding"] for x in listed] == [False] * (len(want) - r) + [True] * r
        for k, (item, i) in enumerate(zip(listed, want)):
            ref = offline[i]
            assert item["sample_id"] == ref["sample_id"], (r, k)
            for key, t in ref.items():
                if not isinstance(t, torch.Tensor):
                    continue
                got = tensors[f"{k}/{key}"]
                if key == "loss_mask" and item["padding"]:
                    assert not got.any()  # a padding sample adds nothing to a masked loss
                    continue
                assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), \
                    (r, k, key)


def test_share_splits_by_record_and_evens_the_remainder():
    def items(n: int, failures: set) -> list:
        return [SimpleNamespace(source_index=i, failure=i in failures) for i in range(n)]

    def split(n, failures, world, remainder):
        shares = [Share(r, world, remainder) for r in range(world)]
        return [[(i.source_index, pad) for i, pad in s.assign(items(n, failures))] for s in shares], shares

    got, _ = split(10, {2}, 2, "keep")  # records are rows 0 1 3 4 5 6 7 8 9; failure 2 on rank 2 % 2
    assert got == [[(0, False), (2, False), (3, False), (5, False), (7, False), (9, False)],
                   [(1, False), (4, False), (6, False), (8, False)]]
    got, shares = split(10, {2}, 2, "drop")
    assert got[0][-1] == (7, False) and len([g for g in got[0] if g[0] != 2]) == len(got[1]) == 4
    assert [s.dropped for s in shares] == [1, 1] and [s.records for s in shares] == [9, 9]
    got, shares = split(10, {2}, 2, "pad")
    assert got[1][-1] == (0, True) and [s.padded for s in shares] == [0, 1]
    got, _ = split(11, set(), 3, "pad")  # 11 records, 3 ranks: rank 2 is short and repeats record 0
    assert [len(g) for g in got] == [4, 4, 4] and got[2][-1] == (0, True)
    got, _ = split(2, set(), 4, "pad")  # fewer records than ranks: the first ones again, in turn
    assert got == [[(0, False)], [(1, False)], [(0, True)], [(1, True)]]
    got, _ = split(3, {0, 1, 2}, 2, "drop")  # failures only: no records to even out
    assert got == [[(0, False), (2, False)], [(1, False)]]
    with pytest.raises(HsxError, match="remainder must be one of keep, drop, pad"):
        Share(0, 2, "repeat")


def test_rank_and_world_size_come_from_torchrun_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ranks_from() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert ranks_from() == (1, 2) and ranks_from(0) == (0, 2) and ranks_from(world_size=1) == (0, 1)
    with pytest.raises(HsxError, match="needs 0 <= rank < world_size"):
        ranks_from(2)
    monkeypatch.delenv("RANK")
    with pytest.raises(HsxError, match="needs rank= as well"):
        ranks_from()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(HsxError, match="WORLD_SIZE='two'"):
        ranks_from()


def test_ranks_without_ray_or_out_of_order_are_refused(setup):
    with pytest.raises(HsxError, match="needs its engines on Ray"):
        hsx.stream(config(setup), rank=0, world_size=2)
    with pytest.raises(HsxError, match="ordered=False cannot be shared"):
        hsx.stream(shared(setup, "auto"), rank=0, world_size=2, ordered=False)
    with pytest.raises(HsxError, match="remainder must be one of"):
        hsx.stream(config(setup), remainder="even")


# --- joining Ray: no cluster running, and a cluster that checks tokens

def fresh_trainer_env(tmp_path: Path) -> dict:
    """A trainer's environment on a machine where no Ray runs: its own Ray temporary directory (so
    ``auto`` finds no other cluster of this machine), its own home (no ``~/.ray/auth_token`` yet), no
    Ray address or authentication mode inherited from this test process."""
    ray_tmp = Path(f"/tmp/hsxr-{os.getpid()}-{tmp_path.name[-12:]}")  # short: Ray's socket paths have a length limit
    ray_tmp.mkdir(exist_ok=True)
    (tmp_path / "home").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    return {**env, "RAY_TMPDIR": str(ray_tmp), "TMPDIR": str(ray_tmp), "HOME": str(tmp_path / "home")}


def ray_processes_under(ray_tmp: str) -> list[int]:
    """Pids of processes whose command line names ``ray_tmp`` (a cluster's raylet, GCS and helpers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and ray_tmp.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_standalone_ranks_need_no_running_ray(setup, shards, tmp_path):
    env = fresh_trainer_env(tmp_path)
    cfg = shared(setup, None)  # no ray_address, no RAY_ADDRESS, nothing running: rank 0 starts a local Ray
    run_to_end(torchrun(setup, None, "standalone", tmp_path, cfg=cfg, env=env), tmp_path)
    offline = list(shards)
    records = [[i for i in read_items(tmp_path, f"rank{r}-pass0") if i.kind == "record"] for r in range(2)]
    assert [len(r) for r in records] == [23, 22]
    for r in range(2):
        for k, got in enumerate(records[r]):
            assert_same(got, offline[r + 2 * k])
    time.sleep(2)  # the owner's ray.shutdown() has returned; give its processes a moment to go
    assert ray_processes_under(env["RAY_TMPDIR"]) == []  # rank 0 stopped the cluster it started
    assert not list(Path(env["RAY_TMPDIR"]).glob("*.ray-address.json"))  # and took back its address


RAY_FOUND_NOTHING = ConnectionError("Could not find any running Ray instance. Please specify the one to connect to "
                                    "by setting `--address` flag or `RAY_ADDRESS` environment variable.")  # Ray 2.60's


def test_rank_0_closes_the_pool_only_once_the_others_closed_their_feeds():
    """Rank 1's ``finish`` flips it to done before its answer has left the pool: rank 0's close waits
    for rank 1 to close its feed too (or for its process to end), and no longer than the grace when
    it does not."""
    import threading

    from hsx.run.scale.ranks import FeedPool

    def closing(pool, grace):
        done = threading.Event()
        threading.Thread(target=lambda: (pool.wait_others(HANG_GUARD, grace), done.set()), daemon=True).start()
        return done

    pool = FeedPool(ExtractConfig(model="m", dataset="d", output="", ray=True).to_dict(), 2, 1, "test")
    pool.tokens, pool.pass_no = {0: "a", 1: "b"}, 0
    pool.ranks[0].pass_no = pool.ranks[1].pass_no = 0
    pool.ranks[0].status = pool.ranks[1].status = "in"
    done = closing(pool, grace=HANG_GUARD)
    pool.finish(1, 0)
    assert pool.ranks[1].status == "done"
    assert not done.wait(0.5)  # done, but its feed still open: rank 0 waits
    pool.close_rank(1)
    assert done.wait(HANG_GUARD)

    pool.ranks[1].status = "done"  # a rank that never closes its feed holds rank 0 back for the grace only
    assert closing(pool, grace=0.1).wait(HANG_GUARD)


def test_ranks_on_several_machines_with_no_cluster_are_told_how_to_start_one(monkeypatch):
    """A rank of a launcher that does not say every rank is on this machine joins ``auto``; when Ray
    finds no cluster (its own error, raised here: ``auto`` also finds other users' clusters on a
    shared machine), the message names the commands that start one."""
    import hsx.run.scale.ranks as ranks
    from hsx.run.scale.cluster import join_refusal

    def no_cluster(cfg):  # ray_runner.connect, past ray.init: the error it raises when Ray found nothing
        assert cfg.ray_address == "auto"
        raise join_refusal(cfg.ray_address, RAY_FOUND_NOTHING)

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ranks, "connect", no_cluster)
    with pytest.raises(HsxError) as said:
        ranks.RankSource(ExtractConfig(model="m", dataset="d", output="", ray=True), rank=1, world=2)
    said = str(said.value)
    assert "no running Ray cluster was found" in said and "ray start --head --port 6379" in said, said
    assert 'ray_address = "HEAD_IP:6379"' in said and "RAY_ADDRESS" in said and "one machine need none" in said, said


TOKEN_CLUSTER_PROGRAM = """
import sys, time, ray
ray.init(address="local", num_cpus=1, include_dashboard=False)  # Ray 2.60: token authentication on by default
print(ray.get_runtime_context().gcs_address, flush=True)
time.sleep(600)
"""

JOIN_PROGRAM = """
import sys, ray
from hsx.config import ExtractConfig
from hsx.errors import HsxError
from hsx.run.scale.ray_runner import connect
try:
    connect(ExtractConfig(model="m", dataset="d", output="", ray=True, ray_address=sys.argv[1]))
    print("joined", ray.cluster_resources().get("CPU"))
except HsxError as e:
    print(e)
"""


@pytest.mark.slow
def test_a_cluster_checking_tokens_is_joined_by_its_address(tmp_path):
    env = fresh_trainer_env(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", TOKEN_CLUSTER_PROGRAM], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        address = holder.stdout.readline().strip()
        assert (tmp_path / "home" / ".ray" / "auth_token").is_file()  # the cluster checks tokens
        said = subprocess.run([sys.executable, "-c", JOIN_PROGRAM, address], env=env, capture_output=True, text=True,
                              timeout=HANG_GUARD).stdout
        assert said.strip() == "joined 1.0", said
    finally:
        holder.terminate()
        holder.wait(timeout=60)
