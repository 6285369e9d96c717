"""A disk that fills mid-run: a clear error (directory, shard, bytes), every shard committed before stays
committed, no partial file under a shard name, and the same command resumes to the output an uninterrupted
run gives. The full disk is injected under the Parquet writer: its file object raises ENOSPC once a byte
budget shared by every shard file is spent, as a real full disk does, without root."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.shards import writer
from hsx.shards.manifest import load_manifest

torch.set_num_threads(1)


class _FullDisk:
    """A file whose writes fail with ENOSPC once the shared budget is spent (the bytes before it land)."""

    def __init__(self, f, budget: list[int]):
        self.f, self.budget = f, budget

    def write(self, data) -> int:
        n = len(memoryview(data))
        if n > self.budget[0]:
            self.f.write(memoryview(data)[:self.budget[0]])
            self.budget[0] = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget[0] -= n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.fixture
def fill_disk_after(monkeypatch):
    def install(budget: int) -> None:
        left = [budget]
        real = writer.pq.ParquetWriter

        def parquet_writer(where, schema, **kwargs):
            return real(_FullDisk(open(where, "wb", buffering=0), left), schema, **kwargs)  # unbuffered, as the OS file

        monkeypatch.setattr(writer.pq, "ParquetWriter", parquet_writer)
    return install


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("disk-full")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=4, hidden_size=64, vocab_size=len(tok), seed=3,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rows = [{"id": f"t{i}", "text": f"Line {i} of the corpus: " + "more words " * (1 + i % 4)} for i in range(12)]
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": str(root / "model"), "data": str(data)}


def _command(setup: dict, out: Path) -> list[str]:
    return ["extract", "--model", setup["model"], "--dataset", setup["data"], "--id-field", "id", "--output", str(out),
            "--mode", "prefill", "--layers", "final,eagle3", "--batch-size", "2", "--max-shard-samples", "2", "--quiet"]


def _same_samples(ref: Path, out: Path) -> None:
    a, b = hsx.open(ref), hsx.open(out)
    assert a.sample_ids == b.sample_ids and len(set(b.sample_ids)) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids)
        for name in a.columns:
            assert torch.equal(x.hidden(name).view(torch.int16), y.hidden(name).view(torch.int16)), (x.sample_id, name)


def test_a_full_disk_fails_clearly_keeps_what_was_committed_and_resumes(setup, tmp_path, fill_disk_after, monkeypatch):
    runner = CliRunner()
    ref = tmp_path / "ref"
    assert runner.invoke(app, _command(setup, ref)).exit_code == 0
    sizes = [s.bytes for s in load_manifest(ref).shards]
    assert len(sizes) == 6

    out = tmp_path / "out"
    fill_disk_after(sum(sizes[:2]) + sizes[2] // 2)  # room for two shards and half of the third
    failed = runner.invoke(app, _command(setup, out))
    assert isinstance(failed.exception, hsx.ShardError), failed.output  # `hsx` prints it as "error: ...", exit 2
    msg = " ".join(str(failed.exception).split())
    assert str(out) in msg and "the disk is full" in msg and "No space left on device" in msg
    # The writer lanes fill files at once, so which shard meets the full disk first varies from run to run;
    # what holds: the shards before it are committed whole, in order, and the message says so.
    m = load_manifest(out)
    failed_shard = int(re.search(r"while writing shard shard-(\d{5})\.parquet \([\d,]+ bytes of it written, removed\)",
                                 msg).group(1))
    committed = [f"shard-{k:05d}.parquet" for k in range(len(m.shards))]
    assert [s.file for s in m.shards] == committed and 1 <= len(m.shards) <= failed_shard and not m.complete
    assert f"{len(m.shards)} shard(s) committed before it" in msg
    assert f"{sum(s.bytes for s in m.shards):,} bytes by this run" in msg
    visible = sorted(p.name for p in out.glob("*.parquet"))
    assert visible == committed  # no partial file under a shard name
    assert not list(out.glob(".*.part"))  # the partial shard was removed
    for p in visible:
        pq.read_table(out / p)  # whole, readable files
    checked = runner.invoke(app, ["verify", str(out)])
    assert checked.exit_code == 0, checked.output

    # space freed: the same command resumes and finishes with what an uninterrupted run wrote
    monkeypatch.undo()
    resumed = runner.invoke(app, _command(setup, out))
    assert resumed.exit_code == 0, resumed.output
    assert load_manifest(out).complete
    _same_samples(ref, out)
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
