"""The reading API a notebook starts from: samples by index or id, ``tokens()`` in the order ``ds[i]``
uses, and docstrings that say what a row is."""

from __future__ import annotations

import pydoc

import numpy as np
import pytest
import torch

import hsx
from hsx.shards.reader import Sample
from shard_fixtures import bits, finite_records, make_metadata, write_sink

WRITTEN = (3, 0, 4, 1, 2)  # the order an engine finished them in; source order is 0..4


@pytest.fixture(params=[{"max_shard_samples": 2}, {"row_group_bytes": 1}, {}], ids=["shards", "row-groups", "one"])
def out_of_order(request, tmp_path):
    meta = make_metadata([4, 2], "float32", "prefill")
    records = finite_records(meta, [3, 6, 2, 5, 4], seed=1)
    write_sink(tmp_path / "out", meta, [records[i] for i in WRITTEN], **request.param)
    return hsx.open(tmp_path / "out"), records


def test_samples_by_id_and_by_index(out_of_order):
    ds, records = out_of_order
    for i, r in enumerate(records):
        by_id = ds[r.sample_id]
        assert by_id.sample_id == r.sample_id == ds[i].sample_id and by_id.index == i
        assert torch.equal(bits(by_id.hidden("l0")), bits(r.hidden["l0"]))
    assert ds[-1].sample_id == records[-1].sample_id
    view = ds.select([records[4].sample_id, records[1].sample_id])
    assert view[records[1].sample_id].index == 1 and view[0].sample_id == records[4].sample_id
    with pytest.raises(KeyError, match="sample id 'nope' is not in this dataset"):
        ds["nope"]
    with pytest.raises(KeyError, match=repr(records[0].sample_id)):
        view[records[0].sample_id]  # in the dataset, not in the view
    with pytest.raises(IndexError):
        ds[len(records)]


@pytest.mark.parametrize("column", ["l0", "l1"])
def test_tokens_follow_dataset_order(out_of_order, column):
    ds, records = out_of_order
    tm = ds.tokens(column)
    assert torch.equal(tm.sample_index, torch.cat([torch.full((r.num_rows,), i) for i, r in enumerate(records)]))
    assert torch.equal(bits(tm.hidden), bits(torch.cat([r.hidden[column] for r in records])))
    assert torch.equal(tm.position, torch.cat([ds[i].positions for i in range(len(ds))]))
    assert torch.equal(tm.token_id, torch.cat([r.input_ids[: r.num_rows] for r in records]))
    with pytest.raises((RuntimeError, ValueError)):
        tm.hidden.add_(1)  # read-only, whether a view or a copy
    # a select() view: its own order and indices
    picked = [records[k].sample_id for k in (4, 0, 2)]
    view_tm = ds.select(picked).tokens(column)
    assert torch.equal(bits(view_tm.hidden), bits(torch.cat([records[k].hidden[column] for k in (4, 0, 2)])))
    assert np.all(np.diff(view_tm.sample_index.numpy()) >= 0)
    # one shard's rows: the same order restricted to the samples that shard holds
    first = ds.tokens(column, shard=0)
    held = set(first.sample_index.tolist())
    assert np.all(np.diff(first.sample_index.numpy()) >= 0)
    assert torch.equal(bits(first.hidden), bits(tm.hidden[torch.isin(tm.sample_index, torch.tensor(sorted(held)))]))


def test_tokens_and_the_streaming_loader_name_the_same_samples(out_of_order, tmp_path):
    ds, records = out_of_order
    tm = ds.tokens("l0")
    loader = hsx.tokens_loader(tmp_path / "out", batch_size=64)
    got = {}
    for b in loader:
        for i, p, h in zip(b["sample_index"].tolist(), b["position"].tolist(), bits(b["l0"])):
            got[(i, p)] = h
    assert len(got) == tm.hidden.shape[0]
    for r in range(tm.hidden.shape[0]):
        assert torch.equal(got[(int(tm.sample_index[r]), int(tm.position[r]))], bits(tm.hidden[r]))


def test_docstrings_say_what_a_row_is():
    text = pydoc.render_doc(Sample, renderer=pydoc.plaintext)
    assert "row j is position j" not in text and "positions[j]" in text
    doc = Sample.hidden.__doc__
    assert doc and all(word in doc for word in ("read-only", "bfloat16", "--keep", "positions[j]", "[rows, W]"))


def test_a_stored_sample_and_a_stream_record_spell_their_columns_alike(tmp_path):
    meta = make_metadata([8, 4])
    records = finite_records(meta, [5, 3], seed=11)
    write_sink(tmp_path, meta, records)
    for s, r in zip(hsx.open(tmp_path), records):
        assert list(s.hidden) == list(r.hidden) == ["l0", "l1"] and len(s.hidden) == 2
        for name in r.hidden:
            assert torch.equal(bits(s.hidden(name)), bits(s.hidden[name]))
            assert torch.equal(bits(r.hidden(name)), bits(r.hidden[name]))
            assert torch.equal(bits(s.hidden[name]), bits(r.hidden(name)))


def test_opening_an_output_and_reading_a_sample_look_at_no_shard_first(tmp_path, monkeypatch):
    """An output of many shards opens from its manifest alone, and a sample's shard is read without a look at
    its name first (in a store, a look is a request); a shard a crash left under its staging name is found."""
    from hsx.shards import reader
    from hsx.shards.manifest import staged_name

    meta = make_metadata([4], "float32", "prefill")
    records = finite_records(meta, [3, 2, 4, 5, 2, 3], seed=2)
    write_sink(tmp_path / "out", meta, records, max_shard_samples=1)
    looked = []
    monkeypatch.setattr(reader, "shard_path", lambda d, name: looked.append(name) or reader.as_path(d) / name)
    ds = hsx.open(tmp_path / "out")
    assert len(ds) == 6 and looked == []
    assert np.array_equal(ds[4].input_ids.numpy(), records[4].input_ids.numpy())
    assert looked == []  # a shard at its visible name is read without a look first
    monkeypatch.undo()
    staged = tmp_path / "out" / staged_name("shard-00002.parquet")
    (tmp_path / "out" / "shard-00002.parquet").rename(staged)  # as a crash between commit and rename leaves it
    ds = hsx.open(tmp_path / "out")
    assert np.array_equal(ds[2].input_ids.numpy(), records[2].input_ids.numpy())
    assert ds._paths[2] == staged
