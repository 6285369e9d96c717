"""``hsx verify --recompute`` on vision-language outputs: each sample's images re-read by their stored path
and checked against their stored hash, the model's own forward given the same pixels.

A clean output passes; faults written through the shard sink (so only a recompute sees them) are caught:
one sample's rows moved by one position, two samples' rows traded, the boundary-0 column holding
boundary 1 (computed by the test's own forward with the pixels), stored mRoPE positions other than the
model's; an image changed or removed after the run is refused in one line naming the sample and image.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from shard_fixtures import rewrite
from typer.testing import CliRunner
from vl_models import build_vl, draw, oracle

import hsx
from hsx.cli import app
from hsx.config import ExtractConfig
from hsx.data.render import Renderer
from hsx.engine.hf.vision import load_vision_target
from hsx.errors import HsxError
from hsx.run.pipeline import extract

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rows(images: dict) -> list[dict]:
    """An image, two images of different sizes, a text-only chat: batched together by the run."""
    return [
        {"id": "one", "messages": [{"role": "user", "content": [{"type": "image", "image": images["a"]},
                                                                {"type": "text", "text": "what is in the picture?"}]},
                                   {"role": "assistant", "content": "a cat on a mat"}]},
        {"id": "text", "messages": [{"role": "user", "content": "no picture here, just words"},
                                    {"role": "assistant", "content": "fine"}]},
        {"id": "two", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file://" + images["b"]}},
            {"type": "text", "text": "and this one"}, {"type": "image", "image": images["c"]}]},
            {"role": "assistant", "content": "two of them"}]},
    ]


@pytest.fixture(scope="module", params=[("qwen2_5_vl", "generate"), ("qwen2_5_vl", "prefill"), ("llava", "generate"),
                                        ("qwen3_vl", "generate"), ("qwen3_vl_moe", "generate"), ("qwen3_5", "generate"),
                                        ("qwen3_5", "prefill"), ("qwen3_5_moe", "generate"), ("gemma3", "generate"),
                                        ("gemma3", "prefill")],
                ids=lambda p: "-".join(p))
def clean(request, tmp_path_factory):
    """A clean output of the family in the mode; the images it read live in its own folder."""
    family, mode = request.param
    root = tmp_path_factory.mktemp(f"{family}-{mode}")
    path = build_vl(family, root / "model")
    (root / "images").mkdir()
    images = {"a": draw(root / "images" / "a.png", 64, 96, 1), "b": draw(root / "images" / "b.png", 120, 50, 2),
              "c": draw(root / "images" / "c.jpg", 56, 28, 3)}
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(images)))
    out = root / "clean"
    extract(ExtractConfig(model=str(path), dataset=str(data), output=str(out), id_field="id", dtype="float32",
                          model_dtype="float32", layers="final,0,2", mode=mode, max_new_tokens=6, batch_size=3),
            progress=False)
    model, tok, processor, spec = load_vision_target(str(path), torch.float32)
    target = SimpleNamespace(family=family, path=path, model=model, tok=tok, processor=processor, spec=spec)
    return SimpleNamespace(target=target, out=out, images=images, mode=mode, root=root)


def recompute_cli(path) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", str(path), "--recompute", "--json"])
    return result.exit_code, json.loads(result.stdout)


def findings(report: dict) -> dict:
    return {s["sample_id"]: {f["matched"] or f["kind"] for f in s["findings"]} for s in report["samples"] if s["findings"]}


def test_clean_output_passes(clean):
    code, out = recompute_cli(clean.out)
    report = out["recompute"]
    assert code == 0, report["samples"]
    assert {s["verdict"] for s in report["samples"]} == {"ok"}
    assert sum(s["rows"] for s in report["samples"]) > 3 * 10  # every row of the three samples, image tokens among them
    assert len(hsx.open(clean.out)[2].vision["images"]) == 2


def test_shifted_traded_and_boundary_faults_are_caught(clean, tmp_path):
    def shifted(k, s, hidden):  # row p holds the state of p-1 (the first row is kept)
        if s.sample_id == "two":
            for name, h in hidden.items():
                hidden[name] = torch.cat([h[:1], h[:-1]])

    code, out = recompute_cli(rewrite(clean.out, tmp_path / "shifted", shifted))
    assert code == 1 and findings(out["recompute"]) == {"two": {"position p-1"}}, findings(out["recompute"])

    src = hsx.open(clean.out)
    a, b = src.select(["one"])[0], src.select(["two"])[0]
    hi = min(a.num_rows, b.num_rows)
    lo = int((a.input_ids[:hi] != b.input_ids[:hi]).nonzero()[0, 0])
    traded_rows = {name: (a.hidden(name)[lo:hi].clone(), b.hidden(name)[lo:hi].clone()) for name in src.columns}

    def traded(k, s, hidden):
        for name, (ra, rb) in traded_rows.items():
            if s.sample_id in ("one", "two"):
                hidden[name][lo:hi] = rb if s.sample_id == "one" else ra

    code, out = recompute_cli(rewrite(clean.out, tmp_path / "traded", traded))
    assert code == 1
    assert findings(out["recompute"]) == {"one": {"sample 'two'"}, "two": {"sample 'one'"}}, findings(out["recompute"])

    t = clean.target
    renderer = Renderer(t.tok, clean.mode, vision=(t.spec, t.processor))
    prompts = {r["id"]: renderer.render(r, i) for i, r in enumerate(rows(clean.images))}

    def boundary_one(k, s, hidden):  # the boundary-0 column holds what the first block returns
        hs, _ = oracle(t, prompts[s.sample_id], s.input_ids.long())
        hidden["b0"][:] = hs[1][0, : hidden["b0"].shape[0]]

    code, out = recompute_cli(rewrite(clean.out, tmp_path / "boundary", boundary_one))
    assert code == 1
    assert findings(out["recompute"]) == {sid: {"boundary 1"} for sid in prompts}, findings(out["recompute"])


def test_rows_run_without_gemma3_token_types_are_caught(clean, tmp_path):
    """Rows of a forward that let Gemma 3's image blocks attend causally only (no ``token_type_ids``): wrong
    values at the image tokens and after them in both samples with images; the text-only one is unchanged."""
    t = clean.target
    if not t.spec.bidirectional:
        pytest.skip("only Gemma 3's image blocks attend both ways")
    renderer = Renderer(t.tok, clean.mode, vision=(t.spec, t.processor))
    prompts = {r["id"]: renderer.render(r, i) for i, r in enumerate(rows(clean.images))}
    sources = {"b0": 0, "b2": 2, "final": -1}

    def causal(k, s, hidden):
        hs, _ = oracle(t, prompts[s.sample_id], s.input_ids.long(), token_types=False)
        for name, h in hidden.items():
            h[:] = hs[sources[name]][0, : h.shape[0]]

    code, out = recompute_cli(rewrite(clean.out, tmp_path / "causal", causal))
    report = out["recompute"]
    assert code == 1
    verdicts = {s["sample_id"]: s["verdict"] for s in report["samples"]}
    assert verdicts["text"] == "ok" and verdicts["one"] != "ok" and verdicts["two"] != "ok", verdicts
    flagged = {f["column"] for s in report["samples"] for f in s["findings"]}
    assert flagged == {"b2", "final"}, flagged  # the embeddings do not depend on the mask


def test_stored_mrope_positions_are_checked(clean, tmp_path):
    if not clean.target.spec.mrope:
        pytest.skip("LLaVA and Gemma 3 run 1-D positions: nothing stored")
    src = hsx.open(clean.out)
    vision = {s.sample_id: s.vision for s in src}
    two = vision["two"]
    block = two["images"][1]  # the second image's positions, run as if it were text
    n = len(two["image_mask"])
    flat = two["mrope_positions"].clone().reshape(3, n)
    flat[:, block["start"] : block["start"] + block["num_tokens"]] = torch.arange(
        block["start"], block["start"] + block["num_tokens"], dtype=flat.dtype)
    vision["two"] = {**two, "mrope_positions": flat.reshape(-1)}
    dst = tmp_path / "positions"
    _rewrite_vision(clean.out, dst, vision)
    code, out = recompute_cli(dst)
    assert code == 1 and findings(out["recompute"]) == {"two": {"positions"}}, findings(out["recompute"])
    found = next(s for s in out["recompute"]["samples"] if s["sample_id"] == "two")["findings"][0]
    assert found["first"] == block["start"] and "differ from the model's rope index" in found["message"]


def _rewrite_vision(src_path, dst, vision: dict):
    from hsx.shards import Manifest, Record, ShardSink

    ds = hsx.open(src_path)
    sink = ShardSink(dst, Manifest(ds.metadata, config_hash="rewritten"))
    for s in ds:
        sink.add(Record(s.sample_id, s.source_index, s.input_ids.long(), s.prompt_len, s.loss_mask, s.finish_reason,
                        {name: s.hidden(name).clone() for name in ds.columns}, s.accept_lens, s.verify_steps,
                        vision=vision[s.sample_id]))
    sink.close()


def test_a_changed_or_missing_image_is_refused_naming_sample_and_image(clean, tmp_path):
    from PIL import Image

    b, c = clean.images["b"], clean.images["c"]
    kept = {p: tmp_path / f"saved{k}" for k, p in enumerate((b, c))}
    for p, copy in kept.items():
        shutil.copyfile(p, copy)
    try:
        img = Image.open(b).convert("RGB")
        img.putpixel((3, 4), tuple(255 - v for v in img.getpixel((3, 4))))  # one pixel
        img.save(b)
        result = runner.invoke(app, ["verify", str(clean.out), "--recompute"])
        assert isinstance(result.exception, HsxError), result.output
        message = str(result.exception)
        assert message.startswith(f"sample 'two' image 0: {b!r} has changed since the run"), message
        assert "\n" not in message
        Image.open(kept[b]).save(b, compress_level=1)  # re-encoded, the same pixels: accepted
        assert runner.invoke(app, ["verify", str(clean.out), "--recompute"]).exit_code == 0
        shutil.move(c, tmp_path / "moved.jpg")
        result = runner.invoke(app, ["verify", str(clean.out), "--recompute"])
        assert isinstance(result.exception, HsxError), result.output
        assert str(result.exception).startswith(f"sample 'two' image 1: {c!r} does not exist"), str(result.exception)
    finally:
        for p, copy in kept.items():
            shutil.copyfile(copy, p)


def test_an_explicit_chunk_is_refused(clean):
    result = runner.invoke(app, ["verify", str(clean.out), "--recompute", "--recompute-chunk", "8"])
    assert isinstance(result.exception, HsxError)
    assert "recomputed one whole sample per forward" in str(result.exception)


def test_check_samples_takes_an_engines_samples_in_memory(clean):
    """``check_samples`` with a reference around the model in memory, on the engine's own samples (no shards)."""
    from hsx.align import ModelShape, parse_layers
    from hsx.engine.hf.vision import VisionEngine
    from hsx.recompute import check_samples, tolerance_for
    from hsx.recompute.images import VisionReference

    t = clean.target
    groups = parse_layers("0,1,final", ModelShape.from_config(t.model.config.get_text_config()), None)
    prompts = [Renderer(t.tok, "prefill", vision=(t.spec, t.processor)).render(r, i)
               for i, r in enumerate(rows(clean.images))]
    samples = [vs.sample for vs in VisionEngine(t.model, groups, t.spec, store_dtype=torch.float32).prefill(prompts)]
    ref = VisionReference.around(t.model, t.spec, t.processor)
    assert ref.recurrent == t.family.startswith("qwen3_5")  # Gated DeltaNet layers: the recurrent allowance
    tol = tolerance_for("float32", "float32", "float32", recurrent=ref.recurrent)
    results = check_samples(ref, samples, groups, tol, "prefill")
    assert [r.verdict for r in results] == ["ok"] * 3 and sum(r.rows for r in results) == sum(
        len(p.input_ids) for p in prompts)
    shifted = samples[2].hidden["b1"].clone()
    samples[2].hidden["b1"] = torch.cat([shifted[:1], shifted[:-1]])
    results = check_samples(ref, samples, groups, tol, "prefill")
    assert [r.verdict for r in results] == ["ok", "ok", "misaligned"]


@pytest.fixture(scope="module")
def from_columns(tmp_path_factory):
    """A Qwen2.5-VL output whose images came from a `datasets` Image column (a `save_to_disk` directory)."""
    import datasets

    root = tmp_path_factory.mktemp("columns")
    path = build_vl("qwen2_5_vl", root / "model")
    a, b = draw(root / "a.png", 64, 96, 1), draw(root / "b.png", 120, 50, 2)
    text = lambda t: [{"type": "text", "text": t}]  # one content type for Arrow: lists of parts throughout
    rows = datasets.Dataset.from_dict({
        "id": ["pair", "text", "one"],
        "messages": [[{"role": "user", "content": [{"type": "image"}, *text("compare"), {"type": "image"}]},
                      {"role": "assistant", "content": text("they differ")}],
                     [{"role": "user", "content": text("no picture")}, {"role": "assistant", "content": text("fine")}],
                     [{"role": "user", "content": [{"type": "image"}, *text("what?")]},
                      {"role": "assistant", "content": text("a shape")}]],
        "images": [[b, a], [], [a]],
    }).cast_column("images", datasets.Sequence(datasets.Image()))
    rows.save_to_disk(str(root / "data"))
    out = root / "out"
    extract(ExtractConfig(model=str(path), dataset=str(root / "data"), output=str(out), id_field="id", dtype="float32",
                          model_dtype="float32", layers="final,0,2", mode="prefill", batch_size=3), progress=False)
    return SimpleNamespace(root=root, out=out, rows=rows, images=(a, b))


def test_images_from_a_dataset_column_are_read_again_from_the_runs_rows(from_columns, tmp_path):
    f = from_columns
    ds = hsx.open(f.out)
    assert [im["source"] for im in ds[0].vision["images"]] == ["column images[0]", "column images[1]"]
    code, report = recompute_cli(f.out)
    checked = report["recompute"]["samples"]
    assert code == 0 and [s["verdict"] for s in checked] == ["ok"] * 3, checked
    assert sum(s["rows"] for s in checked) == sum(len(s.input_ids) for s in ds)  # prefill: a row per token
    # the dataset moved: refused in one line, until --dataset says where it is
    moved = tmp_path / "moved"
    shutil.move(f.root / "data", moved)
    try:
        result = runner.invoke(app, ["verify", str(f.out), "--recompute"])
        assert isinstance(result.exception, HsxError), result.output
        assert "cannot open the run's dataset" in str(result.exception) and "--dataset" in str(result.exception)
        assert "\n" not in str(result.exception)
        ok = runner.invoke(app, ["verify", str(f.out), "--recompute", "--dataset", str(moved)])
        assert ok.exit_code == 0, ok.output
    finally:
        shutil.move(moved, f.root / "data")


def test_a_changed_image_in_the_datasets_column_is_refused(from_columns, tmp_path):
    """The same rows with the first sample's images in the other order: its image 0 is not the one the run read."""
    import datasets

    f = from_columns
    a, b = f.images
    changed = datasets.Dataset.from_dict({"id": f.rows["id"], "messages": f.rows["messages"],
                                          "images": [[a, b], [], [a]]}
                                         ).cast_column("images", datasets.Sequence(datasets.Image()))
    changed.save_to_disk(str(tmp_path / "changed"))
    result = runner.invoke(app, ["verify", str(f.out), "--recompute", "--dataset", str(tmp_path / "changed")])
    assert isinstance(result.exception, HsxError), result.output
    message = str(result.exception)
    assert message.startswith("sample 'pair' image 0: 'column images[0]' has changed since the run"), message
    # the run's first two rows only: the third sample's row is not there
    fewer = f.rows.select(range(2))
    fewer.save_to_disk(str(tmp_path / "fewer"))
    result = runner.invoke(app, ["verify", str(f.out), "--recompute", "--dataset", str(tmp_path / "fewer")])
    assert isinstance(result.exception, HsxError) and "no row 2" in str(result.exception), result.output
