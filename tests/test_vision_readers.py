"""Readers on a vision-language output: the token loader and ``ds.tokens`` pick image or text rows
(``where="image"``, ``"text"``, a position rule and a token rule together), every row checked against
the sample's own rows and its stored ``image_mask``; a text output refuses a token rule in one line.
The three exports keep image tokens out of the loss and record what they do not carry."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from vl_models import build_vl, draw

import hsx
from hsx.config import ExtractConfig
from hsx.errors import HsxError
from hsx.run.pipeline import extract
from hsx.shards import positions


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """A Qwen2.5-VL output in generate mode over image and text-only chats, two samples a shard."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vl-readers")
    path = build_vl("qwen2_5_vl", root / "model")
    a, b = draw(root / "a.png", 64, 96, 1), draw(root / "b.png", 120, 50, 2)
    chats = [
        [{"type": "image", "image": a}, {"type": "text", "text": "what is in the picture?"}],
        "no picture here, just words",
        [{"type": "image", "image": b}, {"type": "text", "text": "and this one"}, {"type": "image", "image": a}],
        [{"type": "text", "text": "a text part alone"}],
        [{"type": "text", "text": "first"}, {"type": "image", "image": b}],
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": c},
                                                                     {"role": "assistant", "content": "ok then"}]}) + "\n"
                            for i, c in enumerate(chats)))
    extract(ExtractConfig(model=str(path), dataset=str(data), output=str(root / "out"), id_field="id", dtype="float32",
                          model_dtype="float32", layers="final,1,eagle3,3", mode="generate", max_new_tokens=4, batch_size=3,
                          max_shard_samples=2), progress=False)
    torch.set_num_threads(threads)
    return root / "out"


def expected(ds, name: str, where: str):
    """(sample, position, row) of every row ``where`` keeps, from each sample's own rows and masks."""
    rule, kind = positions.split_where(where)
    want = []
    for i in range(len(ds)):
        s = ds[i]
        ids, mask = s.input_ids.numpy(), s.loss_mask.numpy()
        image = s.vision["image_mask"].numpy().astype(bool)
        n = len(ids)
        pos = positions.sample_positions(rule, ds.metadata["mode"], n, int(s.prompt_len), mask)
        if kind is not None:
            pos = pos[image[pos] == (kind == "image")]
        hidden = s.hidden(name)
        stored = positions.sample_positions("all", ds.metadata["mode"], n, int(s.prompt_len), mask)
        for p in pos:
            want.append((i, int(p), hidden[int(np.flatnonzero(stored == p)[0])]))
    return want


def loader_rows(out, name: str, where: str):
    got = []
    for batch in hsx.tokens_loader(out, columns=[name], where=where, batch_size=7, shuffle_buffer=0):
        for k in range(len(batch["position"])):
            got.append((int(batch["sample_index"][k]), int(batch["position"][k]), batch[name][k]))
    return sorted(got, key=lambda r: r[:2])


@pytest.mark.parametrize("where", ["image", "text", "loss,text", "completion,text", "all,image"])
def test_the_loader_and_tokens_keep_the_rows_the_rule_names(out, where):
    ds = hsx.open(out)
    assert len(ds._paths) == 3  # several shards, samples of both kinds in each
    want = expected(ds, "b1", where)
    assert want, where
    got = loader_rows(out, "b1", where)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(torch.equal(g[2], w[2]) for g, w in zip(got, want))
    m = ds.tokens("b1", where=where)
    assert list(zip(m.sample_index.tolist(), m.position.tolist())) == [w[:2] for w in want]
    assert torch.equal(m.hidden, torch.stack([w[2] for w in want]))


def test_image_and_text_rows_split_every_row(out):
    ds = hsx.open(out)
    image_token = ds.metadata["vision"]["image_token_id"]
    every, image, text = (ds.tokens("final", where=w) for w in ("all", "image", "text"))
    assert len(image.position) + len(text.position) == len(every.position)
    assert len(image.position) > 0 and len(text.position) > 0
    assert bool((image.token_id == image_token).all()) and not bool((text.token_id == image_token).any())
    # the text rows of a sample with images and of one without
    assert set(text.sample_index.tolist()) == set(range(len(ds)))
    assert set(image.sample_index.tolist()) == {0, 2, 4}


def test_loss_rows_never_predict_an_image_token(out):
    ds = hsx.open(out)
    image_token = ds.metadata["vision"]["image_token_id"]
    for batch in hsx.tokens_loader(out, columns=["final"], where="loss", batch_size=64, shuffle_buffer=0):
        assert not bool((batch["next_token"] == image_token).any())


@pytest.mark.parametrize("where, message", [("image,text", "a position rule and a token rule"),
                                            ("loss,last", "a position rule and a token rule"),
                                            ("pictures", "must be one of")])
def test_a_bad_where_is_refused_naming_what_is_allowed(out, where, message):
    with pytest.raises(HsxError, match=message):
        hsx.tokens_loader(out, where=where)
    with pytest.raises(HsxError, match=message):
        hsx.open(out).tokens("final", where=where)


def test_a_token_rule_on_a_text_output_says_there_is_no_image_mask(tmp_path):
    from shard_fixtures import finite_records, make_metadata, write_sink

    meta = make_metadata([8], mode="generate")
    write_sink(tmp_path / "text", meta, finite_records(meta, [5, 7]))
    with pytest.raises(HsxError, match="image_mask of a vision-language output"):
        hsx.tokens_loader(tmp_path / "text", where="text")
    ds = hsx.open(tmp_path / "text")
    with pytest.raises(HsxError, match="image_mask of a vision-language output"):
        ds.tokens(ds.columns[0], where="image")
    assert len(ds.tokens(ds.columns[0], where="loss").position) > 0


def test_the_exports_keep_image_tokens_out_of_the_loss_and_say_what_they_leave_out(out, tmp_path):
    from safetensors.torch import load_file

    from hsx.export.saelens import export_saelens
    from hsx.export.specforge import export_specforge
    from hsx.export.speculators import export_speculators

    ds = hsx.open(out)
    image_token = ds.metadata["vision"]["image_token_id"]
    export_specforge(out, tmp_path / "sf", progress=False)
    export_speculators(out, tmp_path / "sp", progress=False)
    export_saelens(out, tmp_path / "sae", column="b1", context_size=8, progress=False)
    index = [json.loads(line) for line in (tmp_path / "sf" / "hsx_index.jsonl").read_text().splitlines()]
    seen = 0
    for i in range(len(ds)):
        s = ds[i]
        image = s.vision["image_mask"].bool()
        assert bool((s.input_ids[image] == image_token).all()) and not bool(s.loss_mask[image].any())
        sf = torch.load(tmp_path / "sf" / index[i]["file"], weights_only=True)
        n = len(sf["input_ids"].reshape(-1))
        assert torch.equal(sf["input_ids"].reshape(-1), s.input_ids[:n].to(sf["input_ids"].dtype))
        assert not bool(sf["loss_mask"].reshape(-1)[image[:n]].any())
        sp = load_file(tmp_path / "sp" / "hidden_states" / f"hs_{i}.safetensors")
        assert torch.equal(sp["token_ids"], s.input_ids[:n].to(torch.int64))
        seen += int(image[:n].sum())
    assert seen > 0
    import datasets

    sp_rows = datasets.load_from_disk(str(tmp_path / "sp"))
    for i in range(len(ds)):
        image = ds[i].vision["image_mask"].bool()[: len(sp_rows[i]["loss_mask"])]
        assert not bool(torch.as_tensor(sp_rows[i]["loss_mask"])[image].any())
    for name in ("sf", "sp", "sae"):
        note = json.loads((tmp_path / name / "hsx_export.json").read_text())["vision"]
        assert note["image_token_id"] == image_token
        assert any("mrope_positions" in line for line in note["not_in_this_export"])
        assert any("images" in line for line in note["not_in_this_export"])


def test_the_notebook_shows_image_tokens_apart(out, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    from test_notebook import CELL_TIMEOUT_S, NOTEBOOK, kernel_manager

    from hsx import analysis as A

    ds = hsx.open(out)
    table = A.token_table(ds)
    image_token = ds.metadata["vision"]["image_token_id"]
    assert (table["is_image"] == (table["token_id"] == image_token)).all() and table["is_image"].any()
    kinds, title = A.token_split(ds, table)
    assert set(kinds.unique()) == {"prompt", "completion", "image"} and title.endswith("vs image")
    monkeypatch.setenv("HSX_SHARDS", str(out))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, km=kernel_manager(tmp_path), timeout=CELL_TIMEOUT_S,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # the tiny model's config names Qwen's bos/eos ids, outside its 517-token vocabulary: transformers says so
    # when the notebook loads it; any other warning fails
    warned = [line for o in outputs if o.get("name") == "stderr" for line in o.get("text", "").splitlines()
              if line.strip() and not re.search(r"(bos|eos)_token_id must be `None` or an integer within the vocabulary", line)]
    assert not warned, warned
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    n_image = int(table["is_image"].sum())
    assert f"{n_image} image-token rows, {len(table) - n_image} text rows" in text
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "image tokens: mean |h|" in html
