"""Turn dataset rows into token ids: the prompt to generate from, or the whole sequence to prefill.

Row shapes
    ``messages``       OpenAI style, a list of ``{role, content}`` with role system / user / assistant;
    ``conversations``  ShareGPT style, a list of ``{from, value}`` with from human / gpt / system
                       (``user`` and ``assistant`` are accepted too);
    text               one string column: ``text_field``, else the first of text / prompt / content /
                       question that the dataset has;
    stored             the rows of an hsx output (:mod:`hsx.data.stored`), tokens already: a
                       :class:`StoredPrompt` in the source's mode, see :func:`stored_prompt`.

A dataset may hold several shapes (a jsonl whose rows use different keys loads as the union of
the columns, with nulls where a row lacks a key), so the shape is chosen per row: the first
non-null of messages, conversations, text. An explicit ``text_field`` goes first instead: asking
for a text column means "use it where it is set".

Chats go through the tokenizer's chat template (or ``chat_template``, which replaces it) and are
tokenized without added special tokens, exactly as ``apply_chat_template`` does; the template
writes its own BOS. Plain text is tokenized with the tokenizer's special tokens (BOS for
Llama-style tokenizers).

generate
    A chat that ends with an assistant turn loses that turn; the rest, plus the template's
    generation prompt, is the prompt. A chat that ends with any other turn is prompted whole, so
    the model answers its last turn. Plain text is its own prompt. ``loss_mask`` is all 0 (the
    completion's 1s are added once it exists). A prompt of ``max_length`` tokens or more leaves no
    room to generate and is rejected.
prefill
    The whole chat; ``loss_mask`` is 1 exactly on the assistant turns' content and the end-of-turn
    token(s) the template writes after it. Templates with ``{% generation %}`` markers get their
    mask from ``apply_chat_template(return_assistant_tokens_mask=True)``. For other templates the
    spans are found in the rendered text: an assistant turn i spans from the end of the rendering
    of turns[:i] with a generation prompt to the end of the rendering of turns[:i + 1], minus
    trailing whitespace (the separator before the next turn); tokens overlapping a span get 1.
    That needs each prefix rendering to be a prefix of the full text, which is checked. An empty
    (or whitespace) assistant turn is rejected: its mask would hold the end-of-turn token alone.
    Plain text has 1 on every token but the special tokens the tokenizer adds (BOS, EOS). A
    sequence longer than ``max_length`` is rejected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping

from jinja2.exceptions import TemplateError

from hsx.data import stored
from hsx.data.images import (IMAGE_PARTS, TEXT_PLACEHOLDER, ImageColumn, VisionInputs, VisionSpec, cut_inside_image,
                             image_of_part)
from hsx.errors import HsxError, SampleError

TEXT_FIELDS = ("text", "prompt", "content", "question")
CHAT_SHAPES = {"messages": ("role", "content"), "conversations": ("from", "value")}
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Mode = Literal["generate", "prefill"]


@dataclass
class Prompt:
    sample_id: str  # the id field's value as str if an id field is given, else f"{split}:{index}"
    source_index: int  # row index in the source dataset
    input_ids: list[int]  # generate: the prompt; prefill: the whole sequence
    loss_mask: list[int]  # same length as input_ids, 1 on tokens to learn from


@dataclass
class StoredPrompt(Prompt):
    """A sample of an hsx output: ``input_ids`` and ``loss_mask`` as rendering gives them in the source's
    mode (generate: the prompt, prefill: the whole sequence), and what the source stored of the rest."""

    tokens: list[int]  # the whole stored sequence: prompt + completion
    prompt_len: int
    finish_reason: str
    accept_lens: list[int] | None
    verify_steps: int | None


@dataclass
class VisionPrompt(Prompt):
    """A chat with images for a vision-language target: ``input_ids`` are the expanded ids (each image's
    placeholder repeated to its token count), ``loss_mask`` is 0 on image tokens, ``vision`` holds the
    pixels, grids, hashes and the image-token mask."""

    vision: VisionInputs


def stored_prompt(row: Mapping[str, Any], index: int, mode: Mode) -> StoredPrompt:
    """The prompt of a row of an hsx output (``mode`` is the source's); an error record of the source
    becomes a SampleError with its reason. A row unlike what hsx writes (a loss mask of another
    length; in generate mode, completion tokens not all learned) stops the run: the new output
    would not have the source's fields."""
    sample_id = row["sample_id"]  # and ``index`` is its source index: the loader puts source row k at row k
    if row[stored.SOURCE_ERROR] is not None:
        reason = row[stored.SOURCE_ERROR]
        raise SampleError(sample_id, f"an error record of the hsx output read as the dataset: {reason}")
    tokens, mask, prompt_len = row["input_ids"], row["loss_mask"], row["prompt_len"]
    where = f"sample {sample_id!r} of the hsx output"
    if len(mask) != len(tokens) or not 0 < prompt_len <= len(tokens):
        raise HsxError(f"{where}: {len(tokens)} tokens, {len(mask)} loss-mask values, prompt_len {prompt_len}")
    head = len(tokens)
    if mode == "generate":
        if prompt_len == len(tokens) or min(mask[prompt_len:]) != 1:
            raise HsxError(f"{where}: in generate mode its {len(tokens) - prompt_len} completion tokens should all "
                           "have loss_mask 1, as hsx writes them")
        head = prompt_len
    return StoredPrompt(sample_id, index, list(tokens[:head]), list(mask[:head]), tokens=list(tokens),
                        prompt_len=prompt_len, finish_reason=row["finish_reason"], accept_lens=row["accept_lens"],
                        verify_steps=row["verify_steps"])


def row_shapes(column_names: Iterable[str], text_field: str | None = None, id_field: str | None = None) -> list[tuple[str, str]]:
    """``(shape, column)`` pairs a dataset with these columns can be rendered from, in order of
    preference; fails naming the columns if a named field is missing or none can be rendered."""
    columns = list(column_names)
    if set(stored.COLUMNS) | {stored.SOURCE_ERROR} <= set(columns):
        return [("stored", "input_ids")]
    for role, name in (("--text-field", text_field), ("--id-field", id_field)):
        if name is not None and name not in columns:
            raise HsxError(f"{role} {name!r} is not a column of the dataset; its columns are {columns}")
    text_column = text_field or next((c for c in TEXT_FIELDS if c in columns), None)
    text = [("text", text_column)] if text_column else []
    chats = [(shape, shape) for shape in CHAT_SHAPES if shape in columns]
    candidates = text + chats if text_field else chats + text
    if not candidates:
        raise HsxError(
            f"the dataset has no column to render: looked for 'messages', 'conversations' or a text "
            f"column ({', '.join(TEXT_FIELDS)}; another one can be named with --text-field); "
            f"its columns are {columns}"
        )
    return candidates


class Renderer:
    def __init__(
        self,
        tokenizer,
        mode: Mode,
        text_field: str | None = None,
        id_field: str | None = None,
        chat_template: str | None = None,
        max_length: int | None = None,
        split: str = "train",
        vision: tuple[VisionSpec, object] | None = None,
    ):
        """``vision``: ``(spec, image_processor)`` of a vision-language target; rows may then hold images
        (:mod:`hsx.data.images`) and render to :class:`VisionPrompt`."""
        if mode not in ("generate", "prefill"):
            raise HsxError(f"mode must be 'generate' or 'prefill', got {mode!r}")
        self.tokenizer = tokenizer
        self.mode = mode
        self.text_field = text_field
        self.id_field = id_field
        self.chat_template = chat_template
        self.max_length = max_length
        self.split = split
        self.vision = vision
        self._candidates: list[tuple[str, str]] | None = None  # (shape, column), in order of preference
        self._template_marks_assistant = False  # the chat template has {% generation %} markers

    def detect(self, column_names: Iterable[str]) -> str:
        """The dataset's preferred row shape; fails if it has no column this renderer can use."""
        candidates = row_shapes(column_names, self.text_field, self.id_field)
        if candidates[0][0] == "stored" and self.vision is not None:
            raise HsxError("an hsx output's tokens as the dataset of a vision-language target: the output holds no "
                           "pixels to run them with; give the dataset the output was made from")
        chats = [c for c in candidates if c[0] in CHAT_SHAPES]
        if chats:
            self._template_marks_assistant = bool(GENERATION_TAG.search(self._check_template()))
        self._candidates = candidates
        return candidates[0][0]

    def render(self, row: Mapping[str, Any], index: int) -> Prompt:
        """The row's token ids and loss mask; SampleError if the row cannot be rendered."""
        if self._candidates is None:
            self.detect(row.keys())
        if self._candidates[0][0] == "stored":
            return stored_prompt(row, index, self.mode)
        sample_id = self._sample_id(row, index)
        found = next(((s, c) for s, c in self._candidates if row.get(c) is not None), None)
        if found is None:
            columns = [c for _, c in self._candidates]
            raise SampleError(sample_id, f"expected a value in one of the columns {columns}, all are missing or null")
        shape, column = found
        if shape == "text" and self.vision is not None:  # plain text on a vision-language target: no images
            input_ids, loss_mask = self._render_text(sample_id, row[column], column)
            self._check_length(sample_id, len(input_ids))
            return VisionPrompt(sample_id, index, input_ids, loss_mask, VisionInputs(None, None, [], [0] * len(input_ids)))
        if shape == "text":
            input_ids, loss_mask = self._render_text(sample_id, row[column], column)
        elif self.vision is not None:
            images: list[tuple[str, object]] = []
            turns = _turns(sample_id, shape, row[column], (images, ImageColumn(sample_id, row)))
            input_ids, loss_mask = self._render_chat(sample_id, turns)
            spec, processor = self.vision
            input_ids, loss_mask, vision = spec.expand(sample_id, input_ids, loss_mask, [im for _, im in images],
                                                       [src for src, _ in images], processor)
            self._check_length(sample_id, len(input_ids), vision)
            return VisionPrompt(sample_id, index, input_ids, loss_mask, vision)
        else:
            turns = _turns(sample_id, shape, row[column])
            input_ids, loss_mask = self._render_chat(sample_id, turns)
        self._check_length(sample_id, len(input_ids))
        return Prompt(sample_id, index, input_ids, loss_mask)

    def _sample_id(self, row: Mapping[str, Any], index: int) -> str:
        fallback = f"{self.split}:{index}"
        if self.id_field is None:
            return fallback
        value = row.get(self.id_field)
        if value is None:
            raise SampleError(fallback, f"id field {self.id_field!r} is missing or null")
        return str(value)

    def _render_text(self, sample_id: str, text: Any, column: str) -> tuple[list[int], list[int]]:
        if not isinstance(text, str):
            raise SampleError(sample_id, f"column {column!r}: expected a string, found {type(text).__name__}")
        if not text.strip():
            raise SampleError(sample_id, f"column {column!r}: text is empty or whitespace")
        encoded = self.tokenizer(text, add_special_tokens=True, return_special_tokens_mask=True)
        input_ids = list(encoded["input_ids"])
        if self.mode == "generate":
            return input_ids, [0] * len(input_ids)
        return input_ids, [1 - int(m) for m in encoded["special_tokens_mask"]]  # BOS/EOS the tokenizer adds: 0

    def _render_chat(self, sample_id: str, turns: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        if self.mode == "prefill":
            empty = next((i for i, t in enumerate(turns) if t["role"] == "assistant" and isinstance(t["content"], str)
                          and not t["content"].strip()), None)
            if empty is not None:
                raise SampleError(sample_id, f"turn {empty}: the assistant turn is empty or whitespace; in prefill "
                                  "mode its loss mask would be the end-of-turn token alone (a missing reply?)")
        if self.mode == "generate":
            if turns[-1]["role"] == "assistant":
                turns = turns[:-1]
            if not turns:
                raise SampleError(sample_id, "the conversation is a single assistant turn: nothing to prompt with")
            text = self._apply(sample_id, turns, add_generation_prompt=True)
            input_ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            return input_ids, [0] * len(input_ids)
        if self._template_marks_assistant:
            encoded = self._apply(sample_id, turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            return list(encoded["input_ids"]), list(encoded["assistant_masks"])
        return self._prefix_mask(sample_id, turns)

    def _prefix_mask(self, sample_id: str, turns: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """Loss mask for a template without generation markers, from assistant spans in the rendered text."""
        text = self._apply(sample_id, turns)
        spans = []
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            if i == 0:
                raise SampleError(
                    sample_id,
                    "the conversation starts with an assistant turn, whose span cannot be located with a "
                    "chat template without {% generation %} markers",
                )
            before = self._apply(sample_id, turns[:i], add_generation_prompt=True)
            through = self._apply(sample_id, turns[: i + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise SampleError(
                    sample_id,
                    f"the chat template renders turns[:{i + 1}] differently from the start of the whole "
                    "conversation, so assistant spans cannot be located; use a template with "
                    "{% generation %} markers",
                )
            start = len(before)
            spans.append((start, start + len(text[start : len(through)].rstrip())))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        loss_mask = [
            int(any(tok_start < end and tok_end > start for start, end in spans))
            for tok_start, tok_end in encoded["offset_mapping"]
        ]
        return list(encoded["input_ids"]), loss_mask

    def _apply(self, sample_id: str, turns: list[dict[str, str]], **kwargs):
        kwargs.setdefault("tokenize", False)
        try:
            return self.tokenizer.apply_chat_template(turns, chat_template=self.chat_template, **kwargs)
        except TemplateError as exc:  # raise_exception(...) in the template, e.g. roles must alternate
            raise SampleError(sample_id, f"chat template rejected the conversation: {exc}") from exc

    def _check_template(self) -> str:
        try:
            template = self.tokenizer.get_chat_template(self.chat_template)
        except ValueError as exc:
            raise HsxError(
                "the dataset has chat rows but the tokenizer has no chat template; "
                f"pass one with --chat-template ({exc})"
            ) from exc
        if self.mode == "prefill" and not GENERATION_TAG.search(template) and not self.tokenizer.is_fast:
            raise HsxError(
                "prefill loss masks for a chat template without {% generation %} markers need a fast "
                "tokenizer (one that reports character offsets)"
            )
        return template

    def _check_length(self, sample_id: str, length: int, vision: VisionInputs | None = None) -> None:
        if length == 0:
            raise SampleError(sample_id, "rendered to no tokens")
        if self.max_length is None:
            return
        cut = None if vision is None or length <= self.max_length else cut_inside_image(vision, self.max_length)
        if cut is not None:
            raise SampleError(sample_id, f"sequence is {length} tokens; max_length {self.max_length} falls inside the "
                                         f"image block of {cut.source!r} (tokens {cut.start}..{cut.start + cut.num_tokens - 1}); "
                                         "hsx never cuts an image block, the sample is refused")
        if self.mode == "generate" and length >= self.max_length:
            raise SampleError(
                sample_id, f"prompt is {length} tokens; max_length {self.max_length} leaves no room to generate"
            )
        if self.mode == "prefill" and length > self.max_length:
            raise SampleError(sample_id, f"sequence is {length} tokens, longer than max_length {self.max_length}")


def _turns(sample_id: str, shape: str, value: Any, images: tuple[list, ImageColumn] | None = None) -> list[dict]:
    """Validate a chat column and normalise it to [{role, content}] with role in ROLES. With ``images``
    (a vision-language target: the list the row's images are appended to, and its image column), a
    turn with image parts keeps its content as a list of ``{"type": "image"}`` and text parts."""
    role_key, content_key = CHAT_SHAPES[shape]
    expected = f"a list of {{{role_key}, {content_key}}} turns"
    if not isinstance(value, (list, tuple)):
        raise SampleError(sample_id, f"column {shape!r}: expected {expected}, found {type(value).__name__}")
    if not value:
        raise SampleError(sample_id, f"column {shape!r}: expected {expected}, found an empty list")
    turns = []
    for i, turn in enumerate(value):
        where = f"column {shape!r} turn {i}"
        if not isinstance(turn, Mapping):
            found = type(turn).__name__
            raise SampleError(sample_id, f"{where}: expected a {{{role_key}, {content_key}}} mapping, found {found}")
        role, content = turn.get(role_key), turn.get(content_key)
        if role is None or content is None:
            missing = [k for k in (role_key, content_key) if turn.get(k) is None]
            raise SampleError(sample_id, f"{where}: {missing} missing or null; found keys {sorted(turn)}")
        accepted = SHAREGPT_ROLES if shape == "conversations" else {r: r for r in ROLES}
        if not isinstance(role, str) or role not in accepted:
            raise SampleError(sample_id, f"{where}: unknown {role_key} {role!r}; expected one of {list(accepted)}")
        named = f"{where} {content_key}"
        if isinstance(content, str) and images is not None and images[1] and TEXT_PLACEHOLDER in content:
            content = _placeholder_parts(content)  # LLaVA / ShareGPT4V: "<image>" marks the column's next image
            named += f" (cut into parts at its {TEXT_PLACEHOLDER} placeholders)"
        if isinstance(content, (list, tuple)):
            content = _content_of_parts(sample_id, named, content, images)
        if isinstance(content, list):
            turns.append({"role": accepted[role], "content": content})
            continue
        if not isinstance(content, str):
            raise SampleError(sample_id, f"{where}: {content_key} must be a string or a list of text parts, "
                                         f"found {type(content).__name__}")
        if accepted[role] == "user" and not content.strip():
            raise SampleError(sample_id, f"{where}: the user turn is empty or whitespace (nothing to answer)")
        turns.append({"role": accepted[role], "content": content})
    return turns


def _placeholder_parts(text: str) -> list[dict]:
    """A string turn with ``<image>`` placeholders as parts: a value-less image part at each (it takes the row's
    column's next image), the text between as text parts; the newline LLaVA data puts after one is dropped."""
    parts = []
    for k, piece in enumerate(text.split(TEXT_PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
            piece = piece.removeprefix("\n")
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _content_of_parts(sample_id: str, where: str, parts, images: tuple[list, ImageColumn] | None) -> str | list:
    """A turn's content given as OpenAI-style parts. Text parts alone -> their text, joined by a newline
    (as vLLM renders such a list for a template that takes strings). With image parts (a vision-language
    target only) -> the parts as the chat template takes them, each image read and appended to ``images``."""
    texts, out = [], []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            out.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PARTS and images is not None:
            if kind == "input_image":
                raise SampleError(sample_id, f"{where} part {j}: an 'input_image' part (the Responses API's); "
                                             "hsx reads 'image' and 'image_url' parts")
            found, column = images
            found.append(image_of_part(sample_id, f"{where} part {j}", part, column))
            out.append({"type": "image"})
        elif kind in IMAGE_PARTS:
            raise SampleError(sample_id, f"{where} part {j}: an {kind!r} part, but the target model is not a "
                                         "vision-language model hsx runs")
        else:
            found = ("a 'text' part without a string 'text'" if kind == "text" else
                     f"a part of type {kind!r}" if kind is not None else type(part).__name__)
            raise SampleError(sample_id, f"{where} part {j}: expected a 'text', 'image' or 'image_url' part, "
                                         f"found {found}")
    if not out:
        raise SampleError(sample_id, f"{where}: an empty list of parts")
    return out if len(texts) < len(out) else "\n".join(texts)
