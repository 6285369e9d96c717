"""Dataset loading, row rendering (shapes, modes, loss masks, bad input) and the demo tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.resources import files

import datasets
import huggingface_hub.constants
import pytest
from transformers import AutoTokenizer

from hsx.data import Renderer, dataset_fingerprint, describe, load_rows
from hsx.data.render import GENERATION_TAG
from hsx.demo.tokenizer import CHAT_TEMPLATE, build_demo_tokenizer
from hsx.errors import HsxError, SampleError

PROMPTS = str(files("hsx").joinpath("demo_data/prompts.jsonl"))

SYSTEM = {"role": "system", "content": "Answer briefly."}
USER1 = {"role": "user", "content": "How do I reverse a list?"}
ASSISTANT1 = {"role": "assistant", "content": "Use items[::-1] for a copy."}
USER2 = {"role": "user", "content": "And in place?"}
ASSISTANT2 = {"role": "assistant", "content": "Call items.reverse()."}
CHAT = [SYSTEM, USER1, ASSISTANT1, USER2, ASSISTANT2]

# The demo template without its {% generation %} markers: same text, so the same ids and masks
# must come out of the prefix-diff path.
UNMARKED_TEMPLATE = GENERATION_TAG.sub("", CHAT_TEMPLATE).replace("{% endgeneration %}", "")
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(autouse=True)
def _offline_and_private_cache(tmp_path_factory, monkeypatch):
    """No hub access (a hub name fails at once instead of retrying) and a throwaway datasets cache."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_cache"))


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def masked_spans(tok, ids, mask):
    """The decoded text of each contiguous run of mask == 1."""
    spans, run = [], []
    for token, m in zip(ids, mask):
        if m:
            run.append(token)
        elif run:
            spans.append(decode(tok, run))
            run = []
    if run:
        spans.append(decode(tok, run))
    return spans


def demo_text(turns, generation_prompt=False):
    text = "<|bos|>" + "".join(f"<|{t['role']}|>\n{t['content']}<|end|>\n" for t in turns)
    return text + ("<|assistant|>\n" if generation_prompt else "")


def sharegpt(turns):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": names[t["role"]], "value": t["content"]} for t in turns]


# ---------------------------------------------------------------- demo tokenizer


def test_demo_tokenizer_is_deterministic_across_processes(tok):
    code = "from hsx.demo.tokenizer import build_demo_tokenizer as b; print(b().backend_tokenizer.to_str())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert build_demo_tokenizer().backend_tokenizer.to_str() == tok.backend_tokenizer.to_str() == other


def test_demo_tokenizer_vocab_size_and_specials(tok):
    assert len(tok) == 512
    assert len(build_demo_tokenizer(vocab_size=300)) == 300
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|end|>", "<|pad|>")
    for special in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        assert tok.convert_ids_to_tokens(tok.convert_tokens_to_ids(special)) == special
    assert tok("Hello world")["input_ids"][0] == tok.bos_token_id
    assert decode(tok, tok("naïve café 🙂")["input_ids"]) == "<|bos|>naïve café 🙂"  # byte-level: nothing is unknown
    with pytest.raises(ValueError, match="vocab_size"):
        build_demo_tokenizer(vocab_size=100)


def test_demo_tokenizer_saves_and_reloads(tmp_path, tok):
    build_demo_tokenizer(out_dir=tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("Hello world")["input_ids"] == tok("Hello world")["input_ids"]
    assert loaded.apply_chat_template(CHAT, tokenize=False) == demo_text(CHAT)
    assert loaded.eos_token == "<|end|>"


# ---------------------------------------------------------------- rendering: shapes x modes


@pytest.mark.parametrize("shape", ["messages", "conversations"])
def test_chat_generate_prompt_drops_the_last_assistant_turn(tok, shape):
    column = CHAT if shape == "messages" else sharegpt(CHAT)
    renderer = Renderer(tok, "generate", id_field="id")
    assert renderer.detect(["id", shape]) == shape
    prompt = renderer.render({"id": "c1", shape: column}, 0)
    assert decode(tok, prompt.input_ids) == demo_text(CHAT[:-1], generation_prompt=True)
    assert prompt.loss_mask == [0] * len(prompt.input_ids)
    assert (prompt.sample_id, prompt.source_index) == ("c1", 0)


@pytest.mark.parametrize("shape", ["messages", "conversations"])
@pytest.mark.parametrize("template", [None, UNMARKED_TEMPLATE], ids=["generation-markers", "prefix-diff"])
def test_chat_prefill_mask_is_exactly_the_assistant_turns(tok, shape, template):
    column = CHAT if shape == "messages" else sharegpt(CHAT)
    prompt = Renderer(tok, "prefill", chat_template=template).render({shape: column}, 3)
    assert decode(tok, prompt.input_ids) == demo_text(CHAT)
    assert len(prompt.loss_mask) == len(prompt.input_ids)
    assert masked_spans(tok, prompt.input_ids, prompt.loss_mask) == [
        ASSISTANT1["content"] + "<|end|>",
        ASSISTANT2["content"] + "<|end|>",
    ]
    assert prompt.sample_id == "train:3"


@pytest.mark.parametrize("mode", ["generate", "prefill"])
def test_text_rows(tok, mode):
    prompt = Renderer(tok, mode).render({"text": "The kettle clicked off."}, 0)
    assert decode(tok, prompt.input_ids) == "<|bos|>The kettle clicked off."
    # prefill: every token is learned but the BOS the tokenizer adds (nothing predicts it)
    assert prompt.loss_mask == [0] + [int(mode == "prefill")] * (len(prompt.input_ids) - 1)


def test_text_rows_mask_every_special_token_the_tokenizer_adds(tok):
    from tokenizers.processors import TemplateProcessing

    both = build_demo_tokenizer()  # a tokenizer whose post-processor writes BOS and EOS around the text
    both._tokenizer.post_processor = TemplateProcessing(
        single=f"{both.bos_token} $A {both.eos_token}",
        special_tokens=[(both.bos_token, both.bos_token_id), (both.eos_token, both.eos_token_id)])
    prompt = Renderer(both, "prefill").render({"text": "The kettle clicked off."}, 0)
    assert prompt.input_ids[0] == both.bos_token_id and prompt.input_ids[-1] == both.eos_token_id
    assert prompt.loss_mask == [0] + [1] * (len(prompt.input_ids) - 2) + [0]


def test_both_mask_paths_agree_on_every_demo_row(tok):
    ds = load_rows(PROMPTS)
    marked = Renderer(tok, "prefill", id_field="id")
    unmarked = Renderer(tok, "prefill", id_field="id", chat_template=UNMARKED_TEMPLATE)
    for index, row in enumerate(ds):
        a, b = marked.render(row, index), unmarked.render(row, index)
        assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask), a.sample_id


def test_chat_template_override_changes_rendering(tok):
    chat = [USER1, ASSISTANT1]
    default = Renderer(tok, "generate").render({"messages": chat}, 0)
    chatml = Renderer(tok, "generate", chat_template=CHATML_TEMPLATE).render({"messages": chat}, 0)
    assert decode(tok, chatml.input_ids) == f"<|im_start|>user\n{USER1['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.input_ids != default.input_ids
    # a marker-less template: the separator after <|im_end|> is not learned
    prefill = Renderer(tok, "prefill", chat_template=CHATML_TEMPLATE).render({"messages": CHAT}, 0)
    assert masked_spans(tok, prefill.input_ids, prefill.loss_mask) == [
        ASSISTANT1["content"] + "<|im_end|>",
        ASSISTANT2["content"] + "<|im_end|>",
    ]


def test_non_prefix_stable_template_is_rejected_in_prefill(tok):
    # renders only the final assistant turn, as templates that strip earlier reasoning do
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(SampleError, match=r"generation %\} markers") as err:
        Renderer(tok, "prefill", chat_template=template, id_field="id").render({"id": "x9", "messages": CHAT}, 0)
    assert err.value.sample_id == "x9"


@pytest.mark.parametrize(
    "turns, expected_prompt_turns",
    [
        ([USER1], [USER1]),  # no assistant turn: the whole conversation is the prompt
        ([SYSTEM, USER1], [SYSTEM, USER1]),
        ([USER1, ASSISTANT1, USER2], [USER1, ASSISTANT1, USER2]),  # ends with a user turn: answer it
        ([USER1, ASSISTANT1], [USER1]),
    ],
)
def test_generate_mode_prompt_turns(tok, turns, expected_prompt_turns):
    prompt = Renderer(tok, "generate").render({"messages": turns}, 0)
    assert decode(tok, prompt.input_ids) == demo_text(expected_prompt_turns, generation_prompt=True)


def test_prefill_without_assistant_turn_has_empty_mask(tok):
    prompt = Renderer(tok, "prefill").render({"messages": [SYSTEM, USER1]}, 0)
    assert decode(tok, prompt.input_ids) == demo_text([SYSTEM, USER1])
    assert sum(prompt.loss_mask) == 0


def test_assistant_first_conversation(tok):
    row = {"id": "a0", "messages": [ASSISTANT1, USER1, ASSISTANT2]}
    prompt = Renderer(tok, "prefill", id_field="id").render(row, 0)  # generation markers locate it
    assert masked_spans(tok, prompt.input_ids, prompt.loss_mask)[0] == ASSISTANT1["content"] + "<|end|>"
    with pytest.raises(SampleError, match="starts with an assistant turn"):
        Renderer(tok, "prefill", id_field="id", chat_template=UNMARKED_TEMPLATE).render(row, 0)
    with pytest.raises(SampleError, match="single assistant turn"):
        Renderer(tok, "generate").render({"messages": [ASSISTANT1]}, 0)


# ---------------------------------------------------------------- rendering: whole demo file, ids, shape choice


@pytest.mark.parametrize("mode", ["generate", "prefill"])
def test_every_demo_row_renders(tok, mode):
    ds = load_rows(PROMPTS)
    assert len(ds) >= 40 and {"messages", "conversations", "text"} <= set(ds.column_names)
    renderer = Renderer(tok, mode, id_field="id")
    assert renderer.detect(ds.column_names) == "messages"
    prompts = [renderer.render(row, i) for i, row in enumerate(ds)]
    assert [p.sample_id for p in prompts] == ds["id"]
    assert all(len(p.input_ids) == len(p.loss_mask) > 0 for p in prompts)
    by_id = {p.sample_id: p for p in prompts}
    assert decode(tok, by_id["txt-short"].input_ids) == "<|bos|>Hello"
    assert "<|user|>\nWhy did my bread come out dense?" in decode(tok, by_id["sg-bread"].input_ids)
    if mode == "prefill":
        assert masked_spans(tok, by_id["sg-math"].input_ids, by_id["sg-math"].loss_mask) == ["156.<|end|>"]


def test_sample_ids_from_id_field_or_split_index(tok):
    row = {"id": 17, "text": "hello"}
    assert Renderer(tok, "generate", id_field="id").render(row, 5).sample_id == "17"
    assert Renderer(tok, "generate", split="test").render(row, 5).sample_id == "test:5"


def test_shape_is_chosen_per_row(tok):
    renderer = Renderer(tok, "generate")
    assert renderer.detect(["messages", "conversations", "prompt"]) == "messages"
    text_only = {"messages": None, "conversations": None, "prompt": "Hi"}
    assert decode(tok, renderer.render(text_only, 0).input_ids) == "<|bos|>Hi"
    both = {"messages": [USER1], "conversations": None, "prompt": "Hi"}
    assert decode(tok, renderer.render(both, 1).input_ids) == demo_text([USER1], generation_prompt=True)
    # an explicit --text-field wins where it is set
    explicit = Renderer(tok, "generate", text_field="prompt")
    assert explicit.detect(["messages", "prompt"]) == "text"
    assert decode(tok, explicit.render(both, 1).input_ids) == "<|bos|>Hi"
    fallback = explicit.render({"messages": [USER1], "prompt": None}, 2)
    assert decode(tok, fallback.input_ids) == demo_text([USER1], generation_prompt=True)


@pytest.mark.parametrize("column", ["text", "prompt", "content", "question"])
def test_default_text_fields(tok, column):
    renderer = Renderer(tok, "prefill")
    assert renderer.detect(["id", column]) == "text"
    assert decode(tok, renderer.render({column: "Hi"}, 0).input_ids) == "<|bos|>Hi"


# ---------------------------------------------------------------- bad input


BAD_ROWS = [
    ({"text": ""}, "empty or whitespace"),
    ({"text": "  \n\t"}, "empty or whitespace"),
    ({"text": 5}, "expected a string, found int"),
    ({"messages": "hello"}, "expected a list of {role, content} turns, found str"),
    ({"messages": 3}, "found int"),
    ({"messages": []}, "found an empty list"),
    ({"messages": ["hello"]}, "turn 0: expected a {role, content} mapping, found str"),
    ({"messages": [{"content": "hi"}]}, r"\['role'\] missing or null"),
    ({"messages": [{"role": "user"}]}, r"\['content'\] missing or null"),
    ({"messages": [USER1, {"role": "assistant", "content": None}]}, r"turn 1: \['content'\] missing"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "turn 0 content part 0: expected a 'text', 'image' or 'image_url' part, found a 'text' part without a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "image": "a.png"}]}]},
     "turn 0 content part 1: an 'image' part, but the target model is not a vision-language model"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///a.png"}}]}]},
     "turn 0 content part 0: an 'image_url' part"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "part 0: .* found a part of type 'audio'"),
    ({"messages": [{"role": "user", "content": []}]}, "turn 0 content: an empty list of parts"),
    ({"messages": [{"role": "user", "content": 7}]}, "content must be a string or a list of text parts, found int"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "unknown from 'bot'"),
    ({"conversations": [{"role": "user", "content": "hi"}]}, r"\['from', 'value'\] missing"),
    ({"messages": None, "text": None}, "all are missing or null"),
]


@pytest.mark.parametrize("mode", ["generate", "prefill"])
def test_text_parts_render_as_their_text_joined_by_newlines(tok, mode):
    """OpenAI-format chats store text as a list of parts; rendered as vLLM renders them for a string template."""
    renderer = Renderer(tok, mode, id_field="id")
    renderer.detect(["id", "messages"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "hi, how can I help?", "image_url": None}]}]
    plain = [{"role": "user", "content": "hello\nthere"}, {"role": "assistant", "content": "hi, how can I help?"}]
    got, want = renderer.render({"id": "p", "messages": parts}, 0), renderer.render({"id": "p", "messages": plain}, 0)
    assert got.input_ids == want.input_ids and got.loss_mask == want.loss_mask


@pytest.mark.parametrize("mode", ["generate", "prefill"])
@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[str(i) for i in range(len(BAD_ROWS))])
def test_bad_rows_raise_sample_error_naming_the_sample(tok, mode, row, reason):
    renderer = Renderer(tok, mode, id_field="id")
    renderer.detect(["id", "messages", "conversations", "text"])
    with pytest.raises(SampleError, match=reason) as err:
        renderer.render({"id": "bad-1", **row}, 0)
    assert err.value.sample_id == "bad-1"
    assert "bad-1" in str(err.value)


@pytest.mark.parametrize("content", ["", "  \n"])
@pytest.mark.parametrize("where", [1, 3])
def test_empty_assistant_turn_in_prefill_mode_is_a_sample_error(tok, content, where):
    turns = [USER1, ASSISTANT1, USER2, ASSISTANT2]
    turns[where] = {"role": "assistant", "content": content}
    for template in (None, UNMARKED_TEMPLATE):  # both mask paths
        with pytest.raises(SampleError, match=f"turn {where}: the assistant turn is empty or whitespace") as err:
            Renderer(tok, "prefill", id_field="id", chat_template=template).render({"id": "hollow", "messages": turns}, 0)
        assert err.value.sample_id == "hollow"
    if where == 3:  # generate mode drops a last assistant turn: an empty one is a place to answer
        prompt = Renderer(tok, "generate").render({"messages": turns}, 0)
        assert prompt.input_ids == Renderer(tok, "generate").render({"messages": turns[:3]}, 0).input_ids


def test_missing_id_value_uses_split_index(tok):
    with pytest.raises(SampleError, match="id field 'id' is missing or null") as err:
        Renderer(tok, "generate", id_field="id", split="dev").render({"id": None, "text": "hi"}, 7)
    assert err.value.sample_id == "dev:7"


def test_max_length(tok):
    row = {"id": "long", "messages": [USER1, ASSISTANT1]}
    prefill_len = len(Renderer(tok, "prefill").render(row, 0).input_ids)
    prompt_len = len(Renderer(tok, "generate").render(row, 0).input_ids)
    Renderer(tok, "prefill", max_length=prefill_len).render(row, 0)
    with pytest.raises(SampleError, match=f"{prefill_len} tokens, longer than max_length {prefill_len - 1}") as err:
        Renderer(tok, "prefill", max_length=prefill_len - 1, id_field="id").render(row, 0)
    assert err.value.sample_id == "long"
    Renderer(tok, "generate", max_length=prompt_len + 1).render(row, 0)
    with pytest.raises(SampleError, match="no room to generate"):
        Renderer(tok, "generate", max_length=prompt_len, id_field="id").render(row, 0)


def test_template_exception_is_a_sample_error(tok):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}{% endif %}x"
    with pytest.raises(SampleError, match="must start with user"):
        Renderer(tok, "generate", chat_template=template).render({"messages": [SYSTEM, USER1]}, 0)


# ---------------------------------------------------------------- detect: whole-dataset problems


def test_detect_fails_fast_on_missing_columns(tok):
    with pytest.raises(HsxError, match=r"looked for 'messages', 'conversations'.*columns are \['id', 'body'\]"):
        Renderer(tok, "generate").detect(["id", "body"])
    with pytest.raises(HsxError, match=r"--text-field 'body2' is not a column.*\['id', 'body'\]"):
        Renderer(tok, "generate", text_field="body2").detect(["id", "body"])
    with pytest.raises(HsxError, match="--id-field 'uid'"):
        Renderer(tok, "generate", id_field="uid").detect(["id", "text"])
    assert Renderer(tok, "generate", text_field="body").detect(["id", "body"]) == "text"


def test_detect_needs_a_chat_template_for_chat_rows(tok):
    bare = build_demo_tokenizer()
    bare.chat_template = None
    with pytest.raises(HsxError, match="no chat template"):
        Renderer(bare, "prefill").detect(["messages"])
    assert Renderer(bare, "prefill").detect(["text"]) == "text"
    assert Renderer(bare, "prefill", chat_template=CHAT_TEMPLATE).detect(["messages"]) == "messages"


def test_bad_mode(tok):
    with pytest.raises(HsxError, match="mode"):
        Renderer(tok, "score")


# ---------------------------------------------------------------- loading


ROWS = [{"id": f"r{i}", "text": f"row number {i}"} for i in range(6)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_load_files_by_extension(tmp_path, fmt):
    path = tmp_path / f"rows.{fmt}"
    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        write_jsonl(path, ROWS)
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    else:
        ds.to_csv(str(path), index=False)
    loaded = load_rows(str(path))
    assert loaded["id"] == [r["id"] for r in ROWS] and loaded["text"] == [r["text"] for r in ROWS]
    assert load_rows(str(path), limit=2)["id"] == ["r0", "r1"]
    assert len(load_rows(str(path), limit=100)) == len(ROWS)


def test_load_saved_to_disk(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_rows(str(tmp_path / "single"), limit=3)["id"] == ["r0", "r1", "r2"]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert len(load_rows(str(tmp_path / "dict"), split="test")) == 2
    with pytest.raises(HsxError, match=r"no split 'dev'; available splits: \['test', 'train'\]"):
        load_rows(str(tmp_path / "dict"), split="dev")


def test_load_directory_of_data_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    assert len(load_rows(str(tmp_path))) == len(ROWS)
    assert load_rows(str(tmp_path), split="test")["id"] == ["r0"]
    with pytest.raises(HsxError, match=r"available splits: \['test', 'train'\]"):
        load_rows(str(tmp_path), split="validation")


def test_load_builder_with_data_files(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ROWS)
    assert len(load_rows("json", data_files=str(path))) == len(ROWS)


def test_single_file_has_only_train_split(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(HsxError, match=r"has no split 'test'; available splits: \['train'\]"):
        load_rows(str(path), split="test")


def test_load_failures_are_hsx_errors(tmp_path):
    with pytest.raises(HsxError, match="no such file or directory"):
        load_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(HsxError, match="no such file or directory"):
        load_rows("./nowhere/data")
    (tmp_path / "rows.txt").write_text("hello\n")
    with pytest.raises(HsxError, match="unknown file type"):
        load_rows(str(tmp_path / "rows.txt"))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(HsxError, match=r"broken.jsonl:2, column 10: not valid JSON \(Expecting value\)"):
        load_rows(str(tmp_path / "broken.jsonl"))
    with pytest.raises(HsxError, match="limit"):
        load_rows(str(tmp_path / "rows.txt"), limit=-1)


@pytest.mark.parametrize("name,text,what", [("empty.jsonl", "", "the file is empty"),
                                             ("blank.jsonl", "\n  \n", "the file is empty"),
                                             ("empty.json", "", "the file is empty"),
                                             ("header.csv", "id,text\n", "only a header line")])
def test_a_file_with_no_rows_is_an_error_naming_it(tmp_path, name, text, what):
    (tmp_path / name).write_text(text)
    with pytest.raises(HsxError, match=f"{tmp_path / name}: no rows \\({what}\\)"):
        load_rows(str(tmp_path / name))


def test_a_split_with_no_rows_is_an_error_naming_the_dataset(tmp_path):
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "none.parquet"))
    with pytest.raises(HsxError, match=r"none.parquet: no rows \(the Parquet file holds none\)"):
        load_rows(str(tmp_path / "none.parquet"))
    (tmp_path / "none.json").write_text("[]")
    with pytest.raises(HsxError, match=r"none.json': no rows \(the split is empty\)"):
        load_rows(str(tmp_path / "none.json"))
    assert len(load_rows(str(write_jsonl(tmp_path / "rows.jsonl", ROWS)), limit=0)) == 0  # asked for none: fine


def test_hub_name_offline_is_a_clear_error():
    with pytest.raises(HsxError, match=r"cannot read dataset 'someone/some-chats'.*network access"):
        load_rows("someone/some-chats")


def test_fingerprint_and_description(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    ds = load_rows(str(path))
    again = load_rows(str(path))
    assert dataset_fingerprint(ds) == dataset_fingerprint(again)
    assert dataset_fingerprint(load_rows(str(path), limit=2)) != dataset_fingerprint(ds)
    assert describe(ds, str(path), "train") == {
        "source": str(path),
        "split": "train",
        "num_rows": len(ROWS),
        "fingerprint": dataset_fingerprint(ds),
    }
    ds._fingerprint = None  # falls back to hashing the table's content
    same_content = datasets.Dataset.from_list(ROWS)
    same_content._fingerprint = None
    assert dataset_fingerprint(ds) == dataset_fingerprint(same_content)


# ---------------------------------------------------------------- input at scale


@pytest.mark.parametrize("layout", ["jsonl", "parquet", "save_to_disk"])
def test_a_large_input_is_read_from_memory_mapped_arrow_not_held_in_memory(tmp_path, layout):
    n = 50_000
    texts = [f"row {i}: " + "word " * (i % 7) for i in range(n)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    if layout == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), tmp_path / "rows.parquet")
        source = tmp_path / "rows.parquet"
    elif layout == "save_to_disk":
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "saved")
        source = tmp_path / "saved"
    import pyarrow as pa

    before = pa.total_allocated_bytes()
    ds = load_rows(str(source))
    held = pa.total_allocated_bytes() - before  # Arrow buffers in memory; a memory map allocates none
    assert len(ds) == n and ds.cache_files  # the rows are in Arrow files on disk
    assert held < ds.data.nbytes / 10, f"{held:,} bytes of Arrow memory for {ds.data.nbytes:,} bytes of rows"
    seen = sum(1 for i, row in enumerate(ds) if row["text"] == texts[i])  # row by row, as a run takes them
    assert seen == n


def _parsed_here(*args, **kwargs):
    raise AssertionError("the file was parsed in the test's own process")


def test_a_json_file_over_the_bound_is_converted_by_a_child_and_only_mapped_here(tmp_path, monkeypatch):
    import importlib
    import tracemalloc

    from hsx.data.convert import CONVERT_APART_BYTES

    texts = [f"row {i}: " + "word " * (i % 7) for i in range(400_000)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert source.stat().st_size > CONVERT_APART_BYTES  # the real bound, not a lowered one
    # were the builder to run in this process, the load fails
    monkeypatch.setattr(importlib.import_module("datasets.packaged_modules.json.json").Json, "_generate_tables",
                        _parsed_here)
    tracemalloc.start()
    try:
        ds = load_rows(str(source))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ds["text"] == texts
    # parsed here, the builder's look at the first 10 MB takes ~130 MB of Python objects
    assert peak < 24 << 20, f"{peak:,} bytes of Python memory at the peak of the load"


@pytest.mark.parametrize("name,text", [
    ("rows.csv", "id,text\n1,one\n2,\"two, with a comma\"\n3,three\n"),
    # a list of structs whose keys differ: the builder stores it as JSON text (its mixed-types rule)
    ("rows.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"text": "a", "turns": [{"role": "user", "content": "hi"}, {"role": "tool", "name": "calc", "output": 3}]},
        {"text": "b", "turns": [{"role": "user", "content": "yo"}]}])),
])
def test_a_file_converted_by_the_child_reads_as_one_read_here(tmp_path, monkeypatch, name, text):
    (tmp_path / name).write_text(text)
    here = load_rows(str(tmp_path / name))
    monkeypatch.setattr("hsx.data.load.CONVERT_APART_BYTES", 0)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "child-cache"))  # converted afresh
    child = load_rows(str(tmp_path / name))
    assert child.cache_files[0]["filename"].startswith(str(tmp_path / "child-cache"))
    assert child.features == here.features
    assert child.data.table.equals(here.data.table)
    assert child.to_list() == here.to_list()
    assert dataset_fingerprint(child) == dataset_fingerprint(here)  # a resume sees the same input


def test_a_converted_file_is_converted_again_only_when_it_changes(tmp_path, monkeypatch, caplog):
    import logging
    import os

    monkeypatch.setattr("hsx.data.load.CONVERT_APART_BYTES", 0)
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"text": f"first {i}"}) + "\n" for i in range(5)))

    def conversions():
        return [r.conversion for r in caplog.records if hasattr(r, "conversion")]

    with caplog.at_level(logging.INFO, logger="hsx.data.convert"):
        load_rows(str(source))
        assert load_rows(str(source))["text"] == [f"first {i}" for i in range(5)]
        assert [c.ok for c in conversions()] == [True]  # the second load found the cache
        source.write_text("".join(json.dumps({"text": f"second {i}"}) + "\n" for i in range(6)))
        os.utime(source, (source.stat().st_atime, source.stat().st_mtime + 10))
        assert load_rows(str(source))["text"] == [f"second {i}" for i in range(6)]
        assert [c.ok for c in conversions()] == [True, True]


def test_with_no_interpreter_to_start_the_file_is_read_here(tmp_path, monkeypatch):
    monkeypatch.setattr("hsx.data.load.CONVERT_APART_BYTES", 0)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert load_rows(str(path)).to_list() == ROWS


def test_a_bad_file_the_child_cannot_convert_is_read_here_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr("hsx.data.load.CONVERT_APART_BYTES", 0)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": \n')
    with pytest.raises(HsxError, match=r"broken.jsonl:3, column 10: not valid JSON \(Expecting value\)"):
        load_rows(str(tmp_path / "broken.jsonl"))


def test_an_hsx_output_as_input_names_the_first_source_row_it_lacks(tmp_path):
    from shard_fixtures import finite_records, make_metadata, write_sink

    from hsx.data.stored import load_stored_rows

    records = finite_records(make_metadata([8]), [3, 4, 2, 5])
    for k, r in enumerate(records):
        r.source_index = k if k < 2 else k + 1  # rows 0, 1, 3, 4: row 2 is in neither the shards nor the errors
    write_sink(tmp_path / "out", make_metadata([8]), records)
    with pytest.raises(HsxError, match="no sample or error record for source row 2 \\(the next one is row 3\\)"):
        load_stored_rows(str(tmp_path / "out"))
    records[2].source_index = 2
    records[3].source_index = 3
    write_sink(tmp_path / "whole", make_metadata([8]), records)
    assert load_stored_rows(str(tmp_path / "whole"))["source_index"][:] == [0, 1, 2, 3]
