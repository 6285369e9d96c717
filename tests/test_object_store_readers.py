"""Every reader of an output takes it from an S3-compatible store (SeaweedFS on the loopback address,
tests/s3_server.py) as it takes it from local disk: the loader, EAGLE3 training's dataset, the exports,
``inspect``, ``verify`` and ``verify --recompute`` give what they give on the same run written locally.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.demo.models import build_tiny_llama
from hsx.demo.tokenizer import build_demo_tokenizer
from hsx.eagle3 import Eagle3Dataset
from hsx.export.specforge import export_specforge
from hsx.export import export_saelens, export_speculators
from hsx.run.pipeline import extract
from hsx.recompute import recompute
from hsx.shards.verify import inspect
from s3_server import S3Server, s3_env, s3_server  # noqa: F401  (fixtures)
from shard_fixtures import bits

ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Question {i}: how far is the {w}?"},
                                     {"role": "assistant", "content": f"Far enough, {w} {i}."}]}
        for i, w in enumerate(["moon", "sea", "hill", "town", "star", "road", "lake", "wood"])]


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory) -> dict:
    """One generate-mode extract with ``final`` and ``eagle3``, written to local disk and to the store."""
    root = tmp_path_factory.mktemp("store-readers")
    tok = build_demo_tokenizer()
    model = build_tiny_llama(num_layers=8, hidden_size=32, vocab_size=len(tok), seed=6,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    remote = f"s3://{s3_server.bucket}/readers"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        for out in (str(root / "local"), remote):
            extract(ExtractConfig(model=str(root / "target"), dataset=str(data), output=out, id_field="id",
                                  mode="generate", max_new_tokens=6, layers="final,eagle3,8,3", batch_size=2,
                                  max_shard_samples=3), progress=False)
    return {"local": root / "local", "remote": remote, "model": root / "target"}


def test_the_loader_streams_the_store_as_local_disk(runs, s3_env):
    kwargs = dict(columns=["final", "eagle3"], where="loss", batch_size=7, shuffle_buffer=64, seed=3)
    a = list(hsx.tokens_loader(runs["local"], **kwargs))
    b = list(hsx.tokens_loader(runs["remote"], **kwargs))
    assert len(a) == len(b) > 2
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(bits(x[k]) if x[k].is_floating_point() else x[k],
                               bits(y[k]) if y[k].is_floating_point() else y[k]), k


def test_eagle3_training_reads_the_store_as_local_disk(runs, s3_env):
    a, b = Eagle3Dataset(runs["local"]), Eagle3Dataset(runs["remote"])
    assert len(a) == len(b) == len(ROWS)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(bits(x[k]) if x[k].is_floating_point() else x[k],
                                   bits(y[k]) if y[k].is_floating_point() else y[k]), (i, k)
            else:
                assert x[k] == y[k], (i, k)


def tensors_in(path: Path) -> dict:
    out = {}
    for p in sorted(path.rglob("*")):
        if p.suffix == ".safetensors":
            out.update({f"{p.relative_to(path)}:{k}": v for k, v in load_file(p).items()})
        elif p.suffix in (".ckpt", ".pt"):
            got = torch.load(p, weights_only=True)
            out.update({f"{p.relative_to(path)}:{k}": v for k, v in (got.items() if isinstance(got, dict) else [("", got)])})
    return out


def test_the_exports_of_the_store_equal_those_of_local_disk(runs, s3_env, tmp_path):
    import datasets

    for name in ("local", "remote"):
        export_specforge(runs[name], tmp_path / name / "specforge", progress=False, draft_vocab_size=64)
        export_speculators(runs[name], tmp_path / name / "speculators", progress=False)
        export_saelens(runs[name], tmp_path / name / "saelens", column="final", context_size=8, progress=False)
    for kind in ("specforge", "speculators"):
        a, b = tensors_in(tmp_path / "local" / kind), tensors_in(tmp_path / "remote" / kind)
        assert a.keys() == b.keys() and a
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key].contiguous().view(torch.uint8), b[key].contiguous().view(torch.uint8)), key
            else:
                assert a[key] == b[key], key
    a = datasets.load_from_disk(str(tmp_path / "local" / "saelens")).with_format("numpy")
    b = datasets.load_from_disk(str(tmp_path / "remote" / "saelens")).with_format("numpy")
    assert a.num_rows == b.num_rows > 0
    for column in a.column_names:
        assert np.array_equal(a[column], b[column]), column


def test_inspect_verify_and_recompute_read_the_store(runs, s3_env):
    a, b = inspect(runs["local"]), inspect(runs["remote"])
    assert {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}
    shown = CliRunner().invoke(app, ["inspect", runs["remote"]])
    assert shown.exit_code == 0 and f"{len(ROWS)}" in shown.output, shown.output
    checked = CliRunner().invoke(app, ["verify", runs["remote"], "--recompute", "--model", str(runs["model"])])
    assert checked.exit_code == 0, checked.output
    report = recompute(runs["remote"], model=str(runs["model"]), progress=False)
    assert report.ok and report.rows == recompute(runs["local"], model=str(runs["model"]), progress=False).rows > 0


def test_the_loaders_read_ahead_stops_with_its_consumer_and_hands_on_a_stores_error(runs, s3_env):
    import gc
    import threading

    def readers() -> list:
        return [t for t in threading.enumerate() if t.name == "hsx-loader-read-ahead"]

    it = iter(hsx.tokens_loader(runs["remote"], batch_size=3, shuffle_buffer=0))
    next(it)
    assert len(readers()) == 1
    it.close()  # a consumer that stops early: the thread ends, nothing is left reading
    del it
    gc.collect()
    assert not readers()

    # a copy of the output with one shard gone from the store: the error names it, on the consumer's side
    client, bucket = s3_env.client(), s3_env.bucket
    for o in client.list_objects_v2(Bucket=bucket, Prefix="readers/")["Contents"]:
        client.copy_object(Bucket=bucket, Key="gone/" + o["Key"].split("/", 1)[1],
                           CopySource={"Bucket": bucket, "Key": o["Key"]})
    victim = hsx.open(f"s3://{bucket}/gone")._entries[-1].file
    loader = hsx.tokens_loader(f"s3://{bucket}/gone", batch_size=3, shuffle_buffer=0)
    client.delete_object(Bucket=bucket, Key=f"gone/{victim}")
    with pytest.raises(hsx.HsxError, match=victim):
        list(loader)
    assert not readers()


@pytest.mark.parametrize("small", [1 << 23, 64])  # the default (one GET a shard), and every shard "large"
def test_samples_read_from_the_store_equal_local_disk_however_a_shard_is_fetched(runs, s3_env, monkeypatch, small):
    from hsx.storage import store

    monkeypatch.setattr(store, "SMALL_OBJECT", small)
    a, b = hsx.open(runs["local"]), hsx.open(runs["remote"])
    assert len(a) == len(b) == len(ROWS)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.sample_id == y.sample_id and torch.equal(x.input_ids, y.input_ids)
        assert torch.equal(bits(x.hidden("eagle3")), bits(y.hidden("eagle3")))


def test_an_object_opened_for_reading_comes_whole_in_one_get_when_small(s3_server, s3_env, monkeypatch):
    """Objects of 0 bytes, of exactly ``SMALL_OBJECT`` and of one byte more read back whole; the first two in one
    GET, the last through the download."""
    import pyarrow as pa

    from hsx.storage import store

    monkeypatch.setattr(store, "SMALL_OBJECT", 1000)
    st = store.as_path(f"s3://{s3_server.bucket}/whole").store
    gets, downloads = [], []
    real_get, real_download = st.client.get_object, st.client.download_file
    monkeypatch.setattr(st.client, "get_object", lambda **kw: gets.append(kw["Key"]) or real_get(**kw))
    monkeypatch.setattr(st.client, "download_file", lambda *a, **kw: downloads.append(a[1]) or real_download(*a, **kw))
    for size in (0, 1000, 1001):
        key = f"whole/object-{size}"
        data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
        st.put(key, data)
        f = st.open_input(key, pa.OSFile)
        assert f.read() == data, size
        f.close()
    assert gets.count("whole/object-0") == gets.count("whole/object-1000") == 1  # one request each
    assert downloads == ["whole/object-1001"]  # (its own requests go through the client too)
    with pytest.raises(FileNotFoundError):
        st.open_input("whole/no-such-object", pa.OSFile)
