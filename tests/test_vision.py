"""Vision-language targets: rows with images, rendered and run, every stored row against an independent
teacher-forced forward of the model given the same pixels; image tokens and grids against the
processor's own expansion; positions against the model's rope index over the whole sequence."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from hsx.align import ModelShape, parse_layers
from hsx.data.images import VisionSpec, image_hash
from hsx.data.render import Renderer
from hsx.engine.hf.engine import SamplingSettings
from hsx.engine.hf.vision import VisionEngine, load_vision_target
from hsx.errors import HsxError, SampleError
from vl_models import FAMILIES, GEMMA_IMAGE, LLAVA_IMAGE, QWEN_IMAGE, build_vl, draw, oracle

# fp32, batched vs unbatched, relative to the largest reference value: correct rows measured up to 6.5e-7 (Qwen3.5 and
# Qwen3.5-MoE: 1.6e-6 in prefill, 5.6e-6 in decode rows, where their Gated DeltaNet layers run token by token and the
# oracle runs them chunked);
# rows run at 1-D instead of mRoPE positions are off by up to 0.27; Gemma 3 rows run without token_type_ids by
# up to 1.07, and its batched decode through transformers' sliding cache and slot-counted window by 0.48
TOL = 1e-5


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    return {"a": draw(d / "a.png", 64, 96, 1), "b": draw(d / "b.png", 120, 50, 2), "c": draw(d / "c.jpg", 56, 28, 3)}


@pytest.fixture(scope="module", params=FAMILIES)
def target(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = build_vl(request.param, tmp_path_factory.mktemp(request.param))
    model, tok, processor, spec = load_vision_target(str(path), torch.float32)
    return SimpleNamespace(family=request.param, path=path, model=model, tok=tok, processor=processor, spec=spec)


def rows(images):
    """One image, two images of different sizes (a file:// URL among them), a text-only chat."""
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": images["a"]},
                                                   {"type": "text", "text": "what is in the picture?"}]},
                      {"role": "assistant", "content": "a cat on a mat"}]},
        {"messages": [{"role": "user", "content": "no picture here, just words"},
                      {"role": "assistant", "content": "fine"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file://" + images["b"]}},
                                                   {"type": "text", "text": "and this one"},
                                                   {"type": "image", "image": images["c"]}]},
                      {"role": "assistant", "content": "two of them"}]},
    ]


def check_rows(t, prompt, vs, groups, mode: str):
    sample = vs.sample
    ids = sample.input_ids
    hs, positions = oracle(t, prompt, ids)
    n = ids.numel() if mode == "prefill" else ids.numel() - 1
    num_layers = len(hs) - 1
    source = {"b0": 0, "b2": 2, "final": num_layers}
    for g in groups:
        got = sample.hidden[g.name]
        assert got.shape[0] == n, (g.name, got.shape, n)
        want = hs[source[g.name]][0, :n]
        err = (got.float() - want.float()).abs().max().item() / want.abs().max().item()
        assert err < TOL, f"{t.family} {mode} {prompt.sample_id} {g.name}: relative error {err}"
    if positions is not None:  # the positions every token ran at, decode steps included
        assert torch.equal(vs.positions, positions[:, 0]), prompt.sample_id
        assert vs.rope_delta == int(positions.max()) + 1 - ids.numel()
    else:
        assert torch.equal(vs.positions, torch.arange(ids.numel()))


def groups_of(t):
    return parse_layers("0,2,final", ModelShape.from_config(t.model.config.get_text_config()), None)


@pytest.mark.parametrize("mode", ["prefill", "generate"])
@pytest.mark.parametrize("batched", [True, False])
def test_every_row_matches_a_teacher_forced_forward(target, images, mode, batched):
    t = target
    renderer = Renderer(t.tok, mode, vision=(t.spec, t.processor))
    prompts = [renderer.render(r, i) for i, r in enumerate(rows(images))]
    engine = VisionEngine(t.model, groups_of(t), t.spec, store_dtype=torch.float32)
    batches = [prompts] if batched else [[p] for p in prompts]
    sampling = SamplingSettings(max_new_tokens=6, stop_token_ids=(t.tok.eos_token_id,))
    out = [s for b in batches for s in (engine.prefill(b) if mode == "prefill" else engine.generate(b, sampling))]
    assert [len(p.vision.images) for p in prompts] == [1, 0, 2]
    for prompt, vs in zip(prompts, out, strict=True):
        assert vs.sample.input_ids[: len(prompt.input_ids)].tolist() == prompt.input_ids
        if mode == "generate":
            assert vs.sample.input_ids.numel() > len(prompt.input_ids)
        check_rows(t, prompt, vs, engine.groups, mode)


def test_image_tokens_and_grids_are_the_processors(target, images):
    """hsx's expansion against the processor's own placeholder rule on the same rendered text."""
    t = target
    renderer = Renderer(t.tok, "prefill", vision=(t.spec, t.processor))
    for i, row in enumerate(rows(images)):
        prompt = renderer.render(row, i)
        turns = [{"role": m["role"], "content": [{"type": "image"} if p["type"] != "text" else p for p in m["content"]]
                  if isinstance(m["content"], list) else m["content"]} for m in row["messages"]]
        text = t.tok.apply_chat_template(turns, tokenize=False)
        from PIL import Image

        pil = [Image.open(p["image"] if p["type"] == "image" else p["image_url"]["url"][len("file://"):]).convert("RGB")
               for m in row["messages"] if isinstance(m["content"], list) for p in m["content"] if p["type"] != "text"]
        ids = torch.tensor(prompt.input_ids)
        assert prompt.vision.image_mask == (ids == t.spec.image_token_id).int().tolist()
        assert all(prompt.loss_mask[j] == 0 for j in range(len(ids)) if prompt.vision.image_mask[j])
        assert sum(prompt.loss_mask) > 0
        assert [im.sha256 for im in prompt.vision.images] == [image_hash(im) for im in pil]
        if not pil:
            assert prompt.input_ids == t.tok(text, add_special_tokens=False)["input_ids"]
            continue
        if t.family == "llava":
            from transformers import LlavaProcessor

            proc = LlavaProcessor(image_processor=t.processor, tokenizer=t.tok, patch_size=14,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1)
            want = proc(text=[text], images=pil, return_tensors="pt", add_special_tokens=False)
            assert prompt.input_ids == want["input_ids"][0].tolist()
            assert torch.equal(prompt.vision.pixel_values, want["pixel_values"])
        elif t.family == "gemma3":
            from transformers import Gemma3Processor

            proc = Gemma3Processor(image_processor=t.processor, tokenizer=t.tok,
                                   image_seq_length=t.model.config.mm_tokens_per_image)
            want = proc(text=[text], images=[pil], return_tensors="pt", add_special_tokens=False)
            assert prompt.input_ids == want["input_ids"][0].tolist()
            assert prompt.vision.image_mask == want["token_type_ids"][0].tolist()  # the soft tokens only
            assert torch.equal(prompt.vision.pixel_values, want["pixel_values"])
            assert [im.grid for im in prompt.vision.images] == [tuple(want["pixel_values"].shape[-2:])] * len(pil)
            for im in prompt.vision.images:  # framed by <start_of_image> .. <end_of_image>, both loss 0
                assert prompt.input_ids[im.start - 1] == t.model.config.boi_token_id
                assert prompt.input_ids[im.start + im.num_tokens] == t.model.config.eoi_token_id
                assert prompt.loss_mask[im.start - 1] == prompt.loss_mask[im.start + im.num_tokens] == 0
            # the frame's newlines merge with the text beside them: a splice of token ids is not the processor's
            frame = t.tok("\n\n", add_special_tokens=False)["input_ids"]
            block = [proc.tokenizer.boi_token_id] + [t.spec.image_token_id] * 16 + [t.model.config.eoi_token_id]
            ids0 = t.tok(text, add_special_tokens=False)["input_ids"]
            spliced = [x for tok in ids0 for x in (frame + block + frame if tok == t.spec.placeholder_id else [tok])]
            assert spliced != prompt.input_ids and len(spliced) != len(prompt.input_ids)
        else:
            from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

            # the processor class cannot be built without torchvision (its video half); its rule runs on its own
            processor_class = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor,
                               "qwen3_vl": Qwen3VLProcessor, "qwen3_vl_moe": Qwen3VLProcessor,
                               "qwen3_5": Qwen3VLProcessor, "qwen3_5_moe": Qwen3VLProcessor}[t.family]
            pixels = t.processor(images=pil, return_tensors="pt")
            rule = SimpleNamespace(image_processor=t.processor, image_token="<|image_pad|>")
            parts = text.split("<|image_pad|>")
            expanded = parts[0] + "".join(processor_class.replace_image_token(rule, pixels, k) + parts[k + 1]
                                          for k in range(len(pil)))
            assert prompt.input_ids == t.tok(expanded, add_special_tokens=False)["input_ids"]
            assert torch.equal(prompt.vision.image_grid_thw, pixels["image_grid_thw"])
            assert [im.grid for im in prompt.vision.images] == [tuple(g) for g in pixels["image_grid_thw"].tolist()]
        for im in prompt.vision.images:  # each block is the image's tokens, contiguous
            assert prompt.vision.image_mask[im.start : im.start + im.num_tokens] == [1] * im.num_tokens


def test_image_column_of_a_datasets_row(target, images):
    """An HF datasets ``Image`` column, referenced by value-less image parts in order."""
    import datasets

    t = target
    ds = datasets.Dataset.from_dict({
        "messages": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "compare"},
                                                   {"type": "image"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "they differ"}]}]],
        "images": [[images["b"], images["a"]]],
    }).cast_column("images", datasets.Sequence(datasets.Image()))
    renderer = Renderer(t.tok, "prefill", vision=(t.spec, t.processor))
    prompt = renderer.render(ds[0], 0)
    from PIL import Image

    assert [im.source for im in prompt.vision.images] == ["column images[0]", "column images[1]"]
    assert [im.sha256 for im in prompt.vision.images] == [image_hash(Image.open(images[k])) for k in ("b", "a")]
    engine = VisionEngine(t.model, groups_of(t), t.spec, store_dtype=torch.float32)
    check_rows(t, prompt, engine.prefill([prompt])[0], engine.groups, "prefill")


def test_a_length_limit_never_cuts_an_image_block(target, images):
    t = target
    full = Renderer(t.tok, "prefill", vision=(t.spec, t.processor)).render(rows(images)[2], 2)
    second = full.vision.images[1]
    inside = second.start + second.num_tokens // 2
    with pytest.raises(SampleError, match=r"falls inside the image block of .*c\.jpg.*never cuts an image block"):
        Renderer(t.tok, "prefill", max_length=inside, vision=(t.spec, t.processor)).render(rows(images)[2], 2)
    after = second.start + second.num_tokens  # a cut after the block: the plain refusal
    with pytest.raises(SampleError, match=f"sequence is {len(full.input_ids)} tokens, longer than max_length {after}"):
        Renderer(t.tok, "prefill", max_length=after, vision=(t.spec, t.processor)).render(rows(images)[2], 2)


def test_llava_rows_with_image_placeholders_in_their_text(target, images):
    """The LLaVA / ShareGPT4V shape: ``<image>`` in a ShareGPT string turn, the images in the row's ``image`` or
    ``images`` column: rendered as the same chat given as parts, every row checked against the oracle."""
    t = target
    renderer = Renderer(t.tok, "prefill", vision=(t.spec, t.processor))  # the column it renders: its first row's
    llava = {"conversations": [{"from": "human", "value": "<image>\nwhat is in the picture?"},
                               {"from": "gpt", "value": "a cat on a mat"}], "image": images["a"]}
    parts = {"messages": [{"role": "user", "content": [{"type": "image", "image": images["a"]},
                                                       {"type": "text", "text": "what is in the picture?"}]},
                          {"role": "assistant", "content": "a cat on a mat"}]}
    got, want = renderer.render(llava, 0), Renderer(t.tok, "prefill", vision=(t.spec, t.processor)).render(parts, 0)
    assert got.input_ids == want.input_ids and got.loss_mask == want.loss_mask
    assert [im.sha256 for im in got.vision.images] == [im.sha256 for im in want.vision.images]
    assert got.vision.images[0].source == "column image[0]"
    two = {"conversations": [{"from": "human", "value": "compare <image> with <image>\nplease"},
                             {"from": "gpt", "value": "they differ"}], "images": [images["b"], images["c"]]}
    prompt = renderer.render(two, 1)
    assert [im.source for im in prompt.vision.images] == ["column images[0]", "column images[1]"]
    engine = VisionEngine(t.model, groups_of(t), t.spec, store_dtype=torch.float32)
    check_rows(t, prompt, engine.prefill([prompt])[0], engine.groups, "prefill")
    short = {**two, "images": [images["b"]]}  # two placeholders, one image
    with pytest.raises(SampleError, match=r"turn 0 value \(cut into parts at its <image> placeholders\) part 3: an image "
                                          r"part without a value takes the row's next image, but column 'images' holds 1"):
        renderer.render(short, 2)
    # without an image column the text is left as it is (on LLaVA, whose image token it is, a placeholder too many)
    if t.family == "llava":
        with pytest.raises(SampleError, match=r"image placeholders .* for 0 images"):
            renderer.render({"conversations": two["conversations"]}, 3)
    else:
        assert not renderer.render({"conversations": two["conversations"]}, 3).vision.images


def bad_rows(images, family):
    placeholder = {"llava": LLAVA_IMAGE.strip(), "gemma3": GEMMA_IMAGE}.get(family, QWEN_IMAGE)
    user = lambda *parts: {"messages": [{"role": "user", "content": list(parts)}]}
    text = {"type": "text", "text": "look"}
    return [
        (user({"type": "image", "image": "/no/such/file.png"}, text), r"turn 0 content part 0: image file '/no/such/file.png' does not exist"),
        (user(text, {"type": "image", "image": __file__}), r"turn 0 content part 1: cannot read image .*test_vision\.py"),
        (user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), "part 0: 'https://example.com/a.png' is a network URL"),
        (user({"type": "audio", "audio": "x.wav"}, text), "part 0: expected a 'text', 'image' or 'image_url' part, found a part of type 'audio'"),
        (user({"type": "image"}, text), "part 0: an image part without a value takes the row's next image, but the row has no"),
        (user({"type": "image", "image": images["a"]}, {"type": "text", "text": "and " + placeholder}),
         r"holds 2 image placeholders .* for 1 images"),
    ] + ([(user({"type": "image", "image": images["a"]}, {"type": "text", "text": "a <image_soft_token> here"}),
           r"holds the image token \d+ outside an image")] if family == "gemma3" else [])


def test_bad_image_rows_are_error_records_naming_the_part(target, images):
    t = target
    renderer = Renderer(t.tok, "generate", vision=(t.spec, t.processor))
    for i, (row, message) in enumerate(bad_rows(images, t.family)):
        with pytest.raises(SampleError, match=message) as err:
            renderer.render(row, i)
        assert err.value.sample_id == f"train:{i}"
    good = renderer.render(rows(images)[0], 9)  # the renderer goes on after them
    assert len(good.vision.images) == 1


def test_what_is_not_run_is_refused_before_the_first_forward(target):
    t = target
    why = ("speculative decoding is not run on targets with recurrent layers ('linear_attention')"
           if t.family.startswith("qwen3_5") else "the draft is a vision-language model")
    with pytest.raises(HsxError, match=re.escape(f"vision-language target ({t.spec.model_type}): {why}")):
        VisionEngine(t.model, groups_of(t), t.spec, draft_model=t.model)


def test_a_family_hsx_does_not_expand_is_refused():
    with pytest.raises(HsxError, match="vision-language target 'idefics3': hsx expands image tokens for .* only"):
        VisionSpec.of(SimpleNamespace(model_type="idefics3"), None, None)


def test_gemma3_pan_and_scan_is_refused():
    from transformers import Gemma3Config
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    with pytest.raises(HsxError, match="'gemma3': its image processor has do_pan_and_scan set"):
        VisionSpec.of(Gemma3Config(), None, Gemma3ImageProcessorPil(do_pan_and_scan=True))


@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_extract_stores_image_columns_and_rows_that_match_the_oracle(target, images, tmp_path, mode):
    """``hsx extract`` on a vision-language target: the shard's image columns are the renderer's, the
    positions and rope_delta the model's, each row its teacher-forced forward's; a bad row is an error record."""
    import json

    import pyarrow.parquet as pq

    import hsx
    from hsx.config import ExtractConfig
    from hsx.run.pipeline import extract
    from hsx.shards.format import FORMAT_VERSION

    t = target
    data = [{"id": f"r{i}", **r} for i, r in enumerate(rows(images))]
    data.insert(1, {"id": "bad", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]})
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    cfg = ExtractConfig(model=str(t.path), dataset=str(path), output=str(tmp_path / "out"), id_field="id",
                        dtype="float32", model_dtype="float32", layers="0,2,final", mode=mode, max_new_tokens=5,
                        batch_size=2)
    summary = extract(cfg, progress=False)
    assert (summary.samples, summary.errors) == (3, 1)
    ds = hsx.open(tmp_path / "out")
    assert ds.metadata["format_version"] == FORMAT_VERSION == 8
    assert ds.metadata["vision"]["model_type"] == t.family and ds.metadata["vision"]["mrope"] == t.spec.mrope
    assert [e.sample_id for e in ds.errors] == ["bad"] and "network URL" in ds.errors[0].reason
    table = pq.read_table(next((tmp_path / "out").rglob("*.parquet")))
    by_id = {r["sample_id"]: r for r in table.to_pylist()}
    renderer = Renderer(t.tok, mode, vision=(t.spec, t.processor))
    checked = 0
    for i, row in enumerate(rows(images)):
        prompt = renderer.render(row, i)
        stored = by_id[f"r{i}"]
        ids = torch.tensor(stored["input_ids"])
        assert stored["input_ids"][: len(prompt.input_ids)] == prompt.input_ids
        assert stored["image_mask"] == prompt.vision.image_mask + [0] * (len(ids) - len(prompt.input_ids))
        assert all(m == 0 for m, im in zip(stored["loss_mask"], stored["image_mask"], strict=True) if im)
        assert [(im["sha256"], tuple(im["grid"]), im["start"], im["num_tokens"]) for im in stored["images"]] == \
            [(im.sha256, im.grid, im.start, im.num_tokens) for im in prompt.vision.images]
        hs, positions = oracle(t, prompt, ids)
        if positions is not None:
            assert stored["mrope_positions"] == positions[:, 0].reshape(-1).tolist()
            assert stored["rope_delta"] == int(positions.max()) + 1 - len(ids)
        else:
            assert stored["mrope_positions"] is None and stored["rope_delta"] is None
        sample = next(s for s in ds if s.sample_id == f"r{i}")
        n = len(ids) if mode == "prefill" else len(ids) - 1
        for name, b in (("b0", 0), ("b2", 2), ("final", len(hs) - 1)):
            want = hs[b][0, :n]
            err = (sample.hidden(name).float() - want).abs().max().item() / want.abs().max().item()
            assert err < TOL, (f"r{i}", name, err)
            checked += n
    assert checked > 0
    from typer.testing import CliRunner

    from hsx.cli import app

    result = CliRunner().invoke(app, ["verify", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["verify", "--recompute", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output  # the images re-read by path (tests/test_recompute_vision.py)
    with pytest.raises(HsxError, match="the output holds no pixels"):
        Renderer(t.tok, "prefill", vision=(t.spec, t.processor)).detect(ds_columns(tmp_path / "out"))


def ds_columns(out):
    from hsx.data.load import load_rows

    return load_rows(str(out)).column_names


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_server_engines_refuse_a_vision_language_target_before_loading(target, tmp_path, engine):
    from hsx.config import ExtractConfig
    from hsx.engine.contract import load_configs

    cfg = ExtractConfig(model=str(target.path), dataset="unused.jsonl", output=str(tmp_path / "out"), engine=engine)
    with pytest.raises(HsxError, match=f"is a vision-language model \\({target.family}\\); the {engine} engine does "
                                       "not run vision-language targets in hsx: use --engine hf"):
        load_configs(cfg)


def test_a_draft_tree_on_a_vision_language_target_is_refused_before_it_loads(target, tmp_path):
    from hsx.config import ExtractConfig
    from hsx.engine.hf.runner import HFRunner

    cfg = ExtractConfig(model=str(target.path), dataset="unused.jsonl", output=str(tmp_path / "out"),
                        draft_model=str(tmp_path / "no-draft"), spec_topk=4)
    with pytest.raises(HsxError, match=f"vision-language target \\({target.family}\\): draft trees \\(--spec-topk 4\\)"):
        HFRunner(cfg)


def test_dry_run_expands_images_as_the_run_does(target, images, tmp_path):
    import json

    from hsx.config import ExtractConfig
    from hsx.run.estimate import estimate

    t = target
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(images)))
    est = estimate(ExtractConfig(model=str(t.path), dataset=str(path), output=str(tmp_path / "out"), mode="prefill",
                                 layers="final"))
    renderer = Renderer(t.tok, "prefill", vision=(t.spec, t.processor))
    assert est.samples == 3 and not est.errors
    assert est.tokens == sum(len(renderer.render(r, i).input_ids) for i, r in enumerate(rows(images)))


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_deepstack_boundaries_are_what_the_next_block_receives(images, tmp_path, family):
    """Qwen3-VL (and Qwen3-VL-MoE) adds deepstack vision features at image tokens to the outputs of its first
    blocks: hsx stores boundary b as block b's input (after the add), checked against this test's own hooks;
    transformers' ``hidden_states[b]`` (before the add) differs there and only there."""
    torch.set_num_threads(1)
    path = build_vl(family, tmp_path / family)
    model, tok, processor, spec = load_vision_target(str(path), torch.float32)
    t = SimpleNamespace(family=family, path=path, model=model, tok=tok, processor=processor, spec=spec)
    assert spec.deepstack == 2  # the tiny tower's deepstack layers [0, 1]: added after blocks 0 and 1
    groups = parse_layers("0,1,2,final", ModelShape.from_config(model.config.get_text_config()), None)
    engine = VisionEngine(model, groups, spec, store_dtype=torch.float32)
    prompts = [Renderer(tok, "prefill", vision=(spec, processor)).render(r, i) for i, r in enumerate(rows(images))]
    hooked = {}
    blocks = model.model.language_model.layers
    for p, vs in zip(prompts, engine.prefill(prompts), strict=True):
        ids = vs.sample.input_ids
        extra = {"mm_token_type_ids": (ids == spec.image_token_id).int()[None]}
        if p.vision.images:
            extra.update(pixel_values=p.vision.pixel_values, image_grid_thw=p.vision.image_grid_thw)
        handles = [blocks[b].register_forward_pre_hook(lambda m, args, b=b: hooked.__setitem__(b, args[0][0].clone()))
                   for b in range(len(blocks))]
        with torch.inference_mode():
            plain = model(input_ids=ids[None], output_hidden_states=True, **extra).hidden_states  # before the add
        for h in handles:
            h.remove()
        model.model.rope_deltas = None
        image = torch.tensor(p.vision.image_mask, dtype=torch.bool)
        for b in (1, 2):  # blocks 1 and 2 of 3 receive the outputs of blocks 0 and 1 with the features added
            got = vs.sample.hidden[f"b{b}"].float()
            want = hooked[b]
            scale = want.abs().max()
            assert (got - want).abs().max() <= TOL * scale, (p.sample_id, b)
            before = (got - plain[b][0]).abs().amax(-1) / scale  # [N] against transformers' hidden_states[b]
            assert before[~image].max() <= TOL, (p.sample_id, b)
            if image.any() and b <= spec.deepstack:
                assert before[image].min() > 1e-3, (p.sample_id, b, before[image].min())
            else:
                assert before.max() <= TOL, (p.sample_id, b)
    from hsx.config import ExtractConfig
    from hsx.engine.hf.runner import HFRunner

    runner = HFRunner(ExtractConfig(model=str(path), dataset="unused.jsonl", output=str(tmp_path / "out"),
                                    model_dtype="float32"))
    record = runner.describe_vision()
    assert record["deepstack"]["blocks"] == 2 and record["deepstack"]["side"].startswith("after the add")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    torch.set_num_threads(1)
    path = build_vl("gemma3", tmp_path_factory.mktemp("gemma3"))
    model, tok, processor, spec = load_vision_target(str(path), torch.float32)
    return SimpleNamespace(family="gemma3", path=path, model=model, tok=tok, processor=processor, spec=spec)


def test_gemma3_image_blocks_attend_both_ways(gemma, images):
    """Negative control: the same forward without ``token_type_ids`` (causal inside each image block) gives other
    rows from the first image token on, so the grid's check can fail; the engine's rows (three rows of different
    lengths, right-padded in one batch) are the forward with them."""
    t = gemma
    groups = parse_layers("0,1,2,final", ModelShape.from_config(t.model.config.get_text_config()), None)
    prompts = [Renderer(t.tok, "prefill", vision=(t.spec, t.processor)).render(r, i) for i, r in enumerate(rows(images))]
    out = VisionEngine(t.model, groups, t.spec, store_dtype=torch.float32).prefill(prompts)
    assert len({len(p.input_ids) for p in prompts}) == 3
    control = {}
    for p, vs in zip(prompts, out, strict=True):
        ids = vs.sample.input_ids
        with_types, _ = oracle(t, p, ids)
        causal, _ = oracle(t, p, ids, token_types=False)
        image = torch.tensor(p.vision.image_mask, dtype=torch.bool)
        first = int(image.nonzero()[0, 0]) if image.any() else len(ids)
        for name, b in (("b0", 0), ("b1", 1), ("b2", 2), ("final", 3)):
            got, scale = vs.sample.hidden[name].float(), with_types[b][0].abs().max()
            assert (got - with_types[b][0]).abs().max() <= TOL * scale, (p.sample_id, name)
            off = (got - causal[b][0]).abs().amax(-1) / scale  # [N] relative to the rows with token types
            assert off[:first].max() <= TOL, (p.sample_id, name)  # before the first image: the same
            if b == 0 or first == len(ids):  # embeddings, and a text-only row: no mask to differ by
                assert off.max() <= TOL, (p.sample_id, name)
                continue
            # block 0's output differs at every image token but a block's last (it sees its whole block either
            # way); from block 1's output on, every token after the first block differs too
            block_last = torch.tensor([im.start + im.num_tokens - 1 for im in p.vision.images])
            inside = image.clone()
            inside[block_last] = False
            assert off[inside].min() > 1e-3, (p.sample_id, name, off[inside].min())
            if b == 1:
                assert off[~inside].max() <= TOL, (p.sample_id, name)
            else:
                assert off[int(block_last[0]) + 1 :].min() > 1e-3, (p.sample_id, name)
            control[name] = max(control.get(name, 0.0), off.max().item())
    print("rows without token_type_ids, largest relative difference per boundary:", control)


def test_gemma3_boundary_0_is_what_block_0_receives(gemma, images):
    """Boundary 0: the text embeddings scaled by sqrt(hidden) and the projected vision features at image tokens,
    as a pre-hook on block 0 sees them."""
    t = gemma
    groups = parse_layers("0,final", ModelShape.from_config(t.model.config.get_text_config()), None)
    prompt = Renderer(t.tok, "prefill", vision=(t.spec, t.processor)).render(rows(images)[2], 2)
    vs = VisionEngine(t.model, groups, t.spec, store_dtype=torch.float32).prefill([prompt])[0]
    seen = {}
    handle = t.model.model.language_model.layers[0].register_forward_pre_hook(
        lambda m, args: seen.__setitem__("b0", args[0][0].clone()))
    try:
        hs, _ = oracle(t, prompt, vs.sample.input_ids)
    finally:
        handle.remove()
    got = vs.sample.hidden["b0"].float()
    assert torch.equal(got, seen["b0"]) and torch.equal(got, hs[0][0])
    ids, image = vs.sample.input_ids, torch.tensor(prompt.vision.image_mask, dtype=torch.bool)
    hidden = t.model.config.get_text_config().hidden_size
    table = t.model.model.language_model.embed_tokens.weight
    assert torch.allclose(got[~image], table[ids[~image]] * hidden ** 0.5, rtol=1e-6, atol=0)
    with torch.inference_mode():
        features = t.model.model.get_image_features(prompt.vision.pixel_values).pooler_output  # [images, n, H]
    assert torch.equal(got[image], features.reshape(-1, hidden))
    assert not torch.allclose(got[image], table[ids[image]] * hidden ** 0.5)


@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_gemma3_frames_merge_with_the_text_beside_them_as_the_processors(gemma, images, mode):
    """Newlines written next to an image (here added tokens, as in Gemma's vocabulary), images side by side, an
    image last in its turn: hsx's ids, image mask and pixels are Gemma3Processor's on the same rendered text."""
    from PIL import Image
    from transformers import Gemma3Processor

    t = gemma
    a, b, c = ({"type": "image", "image": images[k]} for k in "abc")
    text = lambda s: {"type": "text", "text": s}
    chats = [[text("look\n\n"), a, text("\nand now\n"), b, c, text(" \n\n\nend")],
             [text("first:"), a],
             [a, b, text("  two")]]
    proc = Gemma3Processor(image_processor=t.processor, tokenizer=t.tok,
                           image_seq_length=t.model.config.mm_tokens_per_image)
    renderer = Renderer(t.tok, mode, vision=(t.spec, t.processor))
    for i, parts in enumerate(chats):
        row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "seen"}]}
        prompt = renderer.render(row, i)
        turns = [{"role": "user", "content": [{"type": "image"} if p["type"] == "image" else p for p in parts]}]
        if mode == "prefill":
            turns.append({"role": "assistant", "content": "seen"})
        rendered = t.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=mode == "generate")
        pil = [Image.open(p["image"]).convert("RGB") for p in parts if p["type"] == "image"]
        want = proc(text=[rendered], images=[pil], return_tensors="pt", add_special_tokens=False)
        assert prompt.input_ids == want["input_ids"][0].tolist(), (i, t.tok.convert_ids_to_tokens(prompt.input_ids))
        assert prompt.vision.image_mask == want["token_type_ids"][0].tolist()
        assert torch.equal(prompt.vision.pixel_values, want["pixel_values"])
        learned = [m for m, im in zip(prompt.loss_mask, prompt.vision.image_mask) if im]
        answer = len(t.tok("seen", add_special_tokens=False)["input_ids"]) + 1  # and <|end|>
        assert learned == [0] * 16 * len(pil) and sum(prompt.loss_mask) == (answer if mode == "prefill" else 0)


def test_gemma3_text_beside_an_image_that_is_partly_learned_is_an_error_record(gemma, images):
    """The frame's newlines merge with the text beside the image: a run of text that is partly learned (the
    assistant's words after its turn's header) has no loss mask once encoded again, and the sample is refused."""
    t = gemma
    row = {"messages": [{"role": "user", "content": "draw me something"},
                        {"role": "assistant", "content": [{"type": "text", "text": "here it is"},
                                                          {"type": "image", "image": images["a"]}]}]}
    with pytest.raises(SampleError, match=r"the text '\\nhere it is' next to an image is partly learned"):
        Renderer(t.tok, "prefill", vision=(t.spec, t.processor)).render(row, 0)
