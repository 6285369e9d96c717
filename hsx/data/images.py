"""Images in chat rows: the parts that name them, reading and hashing them, and the tokens a
vision-language model sees for them.

Where an image comes from
    ``{"type": "image", "image": PATH}``                  a local file;
    ``{"type": "image_url", "image_url": {"url": URL}}``  ``file://`` URLs only (also a bare string URL);
                                                          hsx fetches nothing over the network;
    ``{"type": "image"}`` (no value)                      the next image of the row's ``images`` (a list)
                                                          or ``image`` column, e.g. an HF ``datasets``
                                                          ``Image`` feature, in order of appearance;
    ``<image>`` in a string turn (LLaVA, ShareGPT4V)      the same, where the row has such a column: the
                                                          string is cut into text and image parts there
                                                          (one newline right after ``<image>`` dropped).

What the model sees
    The chat template writes one placeholder token per image part (``<|image_pad|>`` inside
    ``<|vision_start|> ... <|vision_end|>`` for Qwen2/2.5/3-VL and Qwen3.5, ``<image>`` for LLaVA,
    ``<start_of_image>`` for Gemma 3); each placeholder is expanded to the number of tokens the
    model's vision tower produces for that image, as the model's processor does (:class:`VisionSpec`).
    The expanded ids are the sample's ids: they are what the model runs over and what the rows align to.

    Gemma 3's processor frames each image with text of its own: the placeholder becomes
    ``"\n\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\n\n"``,
    and the text is tokenized again, so the framing newlines merge with the text beside them
    (``"user\n" + "\n\n"`` is one ``"\n\n\n"`` token in Gemma's vocabulary). hsx does the same on
    the text between the tokenizer's special tokens on either side of each placeholder (the tokenizer
    never merges across those), and refuses a tokenizer whose runs do not decode and re-encode to
    themselves. The image tokens are the soft tokens only: ``<start_of_image>`` and
    ``<end_of_image>`` are text to the model (its embeddings, causal attention); the soft tokens get
    the vision features and attend to each other both ways (``token_type_ids`` 1 on them).

An image's hash is the sha256 of ``"{width}x{height}:"`` followed by its RGB pixels, so a file
re-encoded without a pixel change keeps its hash and any pixel change alters it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import unquote, urlparse

from hsx.errors import HsxError, SampleError

IMAGE_PARTS = ("image", "image_url", "input_image")
IMAGE_COLUMNS = ("images", "image")  # where a part without a value takes its image from, in this order
TEXT_PLACEHOLDER = "<image>"  # LLaVA / ShareGPT4V rows: where each image of the row's column goes in a string turn
COLUMN_SOURCE = re.compile(r"column (\w+)\[(\d+)\]")  # an image's stored source when it came from a dataset column
# Families whose placeholders hsx expands (model_type -> how the processor counts an image's tokens).
MERGED_GRID = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# (tokens = t * h * w // merge_size ** 2 of image_grid_thw, positions from the model's get_rope_index)
# Families that add vision features (deepstack) to the hidden states at image tokens after their first blocks.
# Qwen3.5 has none: its vision tower returns only the merged features (no deepstack_visual_indexes in its config).
DEEPSTACK = ("qwen3_vl", "qwen3_vl_moe")
PATCHES = ("llava",)  # tokens = (H // patch) * (W // patch) (+1 with the CLS feature kept)
# Families whose processor frames each image with text and a fixed number of soft tokens (mm_tokens_per_image),
# which attend to each other both ways inside their block (token_type_ids 1 on them).
FRAMED = ("gemma3",)
FRAME = "\n\n"  # Gemma3Processor.full_image_sequence: FRAME + boi + image * n + eoi + FRAME

@dataclass
class ImageInfo:
    """One image of a sample: where it came from, its pixel hash, its grid and its block of tokens."""

    source: str  # a path, or "column images[k]"
    sha256: str
    size: tuple[int, int]  # (width, height) as read
    grid: tuple[int, ...]  # image_grid_thw (t, h, w) for grid models; (H, W) of the processed pixels otherwise
    start: int  # first token of its block in the expanded ids (Gemma 3: the first soft token, after <start_of_image>)
    num_tokens: int


@dataclass
class VisionInputs:
    """What a sample adds to its ids for the vision tower: pixels, grids and where the image tokens are."""

    pixel_values: Any  # torch.Tensor: [patches, D] for grid models, [images, 3, H, W] otherwise
    image_grid_thw: Any | None  # torch.Tensor [images, 3] for grid models
    images: list[ImageInfo] = field(default_factory=list)
    image_mask: list[int] = field(default_factory=list)  # per token of the expanded ids: 1 on image tokens


def image_hash(image) -> str:
    """sha256 of an image's size and RGB pixels (see the module docstring)."""
    rgb = image.convert("RGB")
    return hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).hexdigest()


def read_image(sample_id: str, where: str, path: str):
    """A local image file as an RGB PIL image; SampleError naming the sample and part if it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except FileNotFoundError:
        raise SampleError(sample_id, f"{where}: image file {path!r} does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise SampleError(sample_id, f"{where}: cannot read image {path!r} ({type(e).__name__}: {e})") from None


def _url_path(sample_id: str, where: str, url: Any) -> str:
    if not isinstance(url, str):
        raise SampleError(sample_id, f"{where}: expected an image URL string, found {type(url).__name__}")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme in ("http", "https"):
        raise SampleError(sample_id, f"{where}: {url!r} is a network URL; hsx reads local images only "
                                     "(download it and give a file:// URL or a path)")
    raise SampleError(sample_id, f"{where}: image URL {url!r} has scheme {parsed.scheme!r}; hsx reads file:// "
                                 "URLs and paths only")


class ImageColumn:
    """The images of a row's ``images`` / ``image`` column, handed out in order to parts without a value."""

    def __init__(self, sample_id: str, row: Mapping[str, Any]):
        self.sample_id = sample_id
        self.name = next((c for c in IMAGE_COLUMNS if row.get(c) is not None), None)
        value = row.get(self.name) if self.name else None
        self.values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        self.used = 0

    def __bool__(self) -> bool:
        return self.name is not None

    def take(self, where: str):
        if self.used >= len(self.values):
            have = f"column {self.name!r} holds {len(self.values)}" if self.name else "the row has no 'images' or 'image' column"
            raise SampleError(self.sample_id, f"{where}: an image part without a value takes the row's next image, "
                                              f"but {have}")
        k, self.used = self.used, self.used + 1
        return f"column {self.name}[{k}]", self._open(self.values[k], f"{where} (column {self.name!r} image {k})")

    def get(self, name: str, k: int, where: str):
        """Image ``k`` of column ``name`` (as a stored source ``column NAME[k]`` names it), as an RGB image."""
        if self.name != name or not 0 <= k < len(self.values):
            have = f"column {self.name!r} holds {len(self.values)}" if self.name else "the row has no 'images' or 'image' column"
            raise SampleError(self.sample_id, f"{where}: expected image {k} of column {name!r}, but {have}")
        return self._open(self.values[k], f"{where} (column {name!r} image {k})")

    def _open(self, value, where: str):
        if hasattr(value, "convert"):  # a PIL image (datasets' decoded Image feature)
            return value.convert("RGB")
        if isinstance(value, Mapping):  # datasets' undecoded Image: {"bytes", "path"}
            if value.get("bytes") is not None:
                import io

                from PIL import Image

                try:
                    return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
                except (OSError, ValueError) as e:
                    raise SampleError(self.sample_id, f"{where}: cannot decode image bytes ({e})") from None
            value = value.get("path")
        if isinstance(value, str):
            return read_image(self.sample_id, where, value)
        raise SampleError(self.sample_id, f"{where}: expected a PIL image, {{'bytes', 'path'}} or a path, "
                                          f"found {type(value).__name__}")


def image_of_part(sample_id: str, where: str, part: Mapping[str, Any], column: ImageColumn) -> tuple[str, Any]:
    """``(source, RGB image)`` of an image part."""
    kind = part["type"]
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, Mapping) else value
        path = _url_path(sample_id, where, url)
        return path, read_image(sample_id, where, path)
    if value is None:
        return column.take(where)
    if isinstance(value, str):
        if "://" in value:
            path = _url_path(sample_id, where, value)
            return path, read_image(sample_id, where, path)
        return value, read_image(sample_id, where, value)
    if isinstance(value, Path):
        return str(value), read_image(sample_id, where, str(value))
    return "inline", column._open(value, where)


@dataclass(frozen=True)
class VisionSpec:
    """How a vision-language family writes and counts image tokens (read from its config and image processor)."""

    model_type: str
    image_token_id: int  # the token the model places vision features at
    image_token: str  # its text; except on framed models, also the placeholder the chat template writes per image
    merge_size: int = 1  # grid models: patches merged into one token along each side
    patch_size: int = 1  # patch models: pixels per patch side
    keeps_cls: bool = False  # patch models: the CLS feature is one more token ("full" feature strategy)
    deepstack: int = 0  # deepstack models: blocks 0..deepstack-1 each have vision features added to their output
    # framed models (Gemma 3): the placeholder is <start_of_image> (placeholder_id), expanded to the frame around
    # tokens_per_image soft image tokens (image_token_id) closed by end_id; the tokenizer re-encodes the framed text
    placeholder_id: int | None = None
    placeholder: str | None = None
    end_id: int | None = None
    tokens_per_image: int = 0
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @property
    def mrope(self) -> bool:
        return self.model_type in MERGED_GRID

    @property
    def bidirectional(self) -> bool:
        """The model's image tokens attend both ways inside their block, given ``token_type_ids`` 1 on them."""
        return self.model_type in FRAMED

    @property
    def written_id(self) -> int:
        """The token the chat template writes once per image."""
        return self.image_token_id if self.placeholder_id is None else self.placeholder_id

    @staticmethod
    def of(model_config, tokenizer, image_processor) -> "VisionSpec":
        kind = getattr(model_config, "model_type", None)
        if kind not in MERGED_GRID + PATCHES + FRAMED:
            raise HsxError(f"vision-language target {kind!r}: hsx expands image tokens for "
                           f"{', '.join(MERGED_GRID + PATCHES + FRAMED)} only")
        token_id = int(model_config.image_token_id)
        if kind in FRAMED:
            if getattr(image_processor, "do_pan_and_scan", None):
                raise HsxError(f"vision-language target {kind!r}: its image processor has do_pan_and_scan set; hsx "
                               "does not run pan-and-scan crops (each crop is one more framed image block)")
            boi = int(model_config.boi_token_id)
            return VisionSpec(kind, token_id, tokenizer.convert_ids_to_tokens(token_id), placeholder_id=boi,
                              placeholder=tokenizer.convert_ids_to_tokens(boi), end_id=int(model_config.eoi_token_id),
                              tokens_per_image=int(model_config.mm_tokens_per_image), tokenizer=tokenizer)
        token = tokenizer.convert_ids_to_tokens(token_id)
        if kind in MERGED_GRID:
            deepstack = len(model_config.vision_config.deepstack_visual_indexes) if kind in DEEPSTACK else 0
            return VisionSpec(kind, token_id, token, merge_size=int(image_processor.merge_size), deepstack=deepstack)
        strategy = model_config.vision_feature_select_strategy
        return VisionSpec(kind, token_id, token, patch_size=int(model_config.vision_config.patch_size),
                          keeps_cls=strategy == "full")

    def pixels(self, image_processor, images: Sequence) -> tuple[Any, Any, list[tuple[int, ...]], list[int]]:
        """``(pixel_values, image_grid_thw or None, grid per image, tokens per image)``."""
        out = image_processor(images=list(images), return_tensors="pt")
        if self.mrope:
            grid = out["image_grid_thw"]
            counts = (grid.prod(-1) // self.merge_size ** 2).tolist()
            return out["pixel_values"], grid, [tuple(g) for g in grid.tolist()], counts
        pixels = out["pixel_values"]
        if out.get("num_crops") is not None and any(int(c) for c in out["num_crops"]):
            raise HsxError("the image processor made pan-and-scan crops; hsx does not run them")
        height, width = int(pixels.shape[-2]), int(pixels.shape[-1])
        n = self.tokens_per_image or (height // self.patch_size) * (width // self.patch_size) + int(self.keeps_cls)
        return pixels, None, [(height, width)] * len(images), [n] * len(images)

    def expand(self, sample_id: str, ids: list[int], mask: list[int], images: Sequence, sources: Sequence[str],
               image_processor) -> tuple[list[int], list[int], VisionInputs]:
        """Placeholders of ``ids`` expanded to each image's tokens; the loss mask 0 on every image token."""
        import torch

        ids_t = torch.tensor(ids, dtype=torch.long)
        at = (ids_t == self.written_id).nonzero()[:, 0]
        if at.numel() != len(images):
            raise SampleError(sample_id, f"the rendered chat holds {at.numel()} image placeholders "
                                         f"({self.placeholder or self.image_token!r}) for {len(images)} images; each "
                                         "image part is one placeholder (is the placeholder written in a text part?)")
        if self.placeholder_id is not None and (ids_t == self.image_token_id).any():
            raise SampleError(sample_id, f"the rendered chat holds the image token {self.image_token_id} outside an "
                                         "image (written in a text part?); the model would place image features there")
        if not images:
            return ids, mask, VisionInputs(None, None, [], [0] * len(ids))
        pixel_values, grid_thw, grids, counts = self.pixels(image_processor, images)
        if self.placeholder_id is not None:
            expanded, loss, image_mask, starts = self._frame(sample_id, ids, mask)
            infos = [ImageInfo(src, image_hash(img), img.size, g, s, n)
                     for src, img, g, s, n in zip(sources, images, grids, starts, counts, strict=True)]
            return expanded, loss, VisionInputs(pixel_values, grid_thw, infos, image_mask)
        repeats = torch.ones(len(ids), dtype=torch.long)
        repeats[at] = torch.tensor(counts, dtype=torch.long)
        is_image = torch.zeros(len(ids), dtype=torch.bool)
        is_image[at] = True
        expanded = ids_t.repeat_interleave(repeats)
        image_mask = is_image.repeat_interleave(repeats)
        loss = torch.tensor(mask, dtype=torch.long).repeat_interleave(repeats).masked_fill(image_mask, 0)
        starts = (repeats.cumsum(0) - repeats)[at].tolist()  # each placeholder's index after expansion
        infos = [ImageInfo(src, image_hash(img), img.size, g, s, n)
                 for src, img, g, s, n in zip(sources, images, grids, starts, counts, strict=True)]
        return expanded.tolist(), loss.tolist(), VisionInputs(pixel_values, grid_thw, infos, image_mask.int().tolist())

    def _frame(self, sample_id: str, ids: list[int], mask: list[int]
               ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Gemma 3's expansion: ``(ids, loss mask, image mask, first soft token of each image)``. Each placeholder
        becomes <start_of_image>, the soft tokens and <end_of_image>; the text runs next to it (between special
        tokens) get the frame's newlines and are encoded again, as the processor's re-tokenization does."""
        # the tokenizer never merges text across its special tokens (Gemma's newline runs are added tokens too,
        # but not special: the trie matches the longest run, so "\n" + "\n\n" is one token after the framing)
        special = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}
        special |= {self.placeholder_id, self.end_id, self.image_token_id}  # added tokens, whatever their flag
        # alternate text runs and special tokens, with a (maybe empty) run between any two special tokens
        pieces: list[tuple[list[int], list[int]]] = [([], [])]
        for t, m in zip(ids, mask, strict=True):
            if t in special:
                pieces += [([t], [m]), ([], [])]
            else:
                pieces[-1][0].append(t)
                pieces[-1][1].append(m)
        out_ids, out_loss, out_image, starts = [], [], [], []
        for k, (run, run_mask) in enumerate(pieces):
            if k % 2:  # a special token
                if run[0] == self.placeholder_id:
                    starts.append(len(out_ids) + 1)
                    block = [self.placeholder_id] + [self.image_token_id] * self.tokens_per_image + [self.end_id]
                    out_ids += block
                    out_loss += [run_mask[0], *[0] * self.tokens_per_image, run_mask[0]]
                    out_image += [0, *[1] * self.tokens_per_image, 0]
                else:
                    out_ids += run
                    out_loss += run_mask
                    out_image += [0]
                continue
            before = k > 0 and pieces[k - 1][0][0] == self.placeholder_id
            after = k + 1 < len(pieces) and pieces[k + 1][0][0] == self.placeholder_id
            if before or after:
                run, run_mask = self._reframe(sample_id, run, run_mask, before, after,
                                              pieces[k - 1 if before else k + 1][1][0])
            out_ids += run
            out_loss += run_mask
            out_image += [0] * len(run)
        return out_ids, out_loss, out_image, starts

    def _reframe(self, sample_id: str, run: list[int], run_mask: list[int], before: bool, after: bool,
                 placeholder_loss: int) -> tuple[list[int], list[int]]:
        """A text run beside a placeholder, with the frame's newlines on the placeholder's side(s), encoded again."""
        tok = self.tokenizer
        text = tok.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if run and tok(text, add_special_tokens=False)["input_ids"] != run:
            raise SampleError(sample_id, f"the tokenizer does not encode the decoded text {text!r} next to an image "
                                         "back to its tokens; hsx cannot frame the image as the processor's "
                                         "re-tokenization does")
        if len(set(run_mask)) > 1:
            raise SampleError(sample_id, f"the text {text!r} next to an image is partly learned (loss mask "
                                         f"{run_mask}); its re-encoding with the image's frame has no loss mask")
        framed = tok((FRAME if before else "") + text + (FRAME if after else ""), add_special_tokens=False)["input_ids"]
        return framed, [run_mask[0] if run else placeholder_loss] * len(framed)


def cut_inside_image(inputs: VisionInputs, limit: int) -> ImageInfo | None:
    """The image whose block a cut after ``limit`` tokens would split, if any."""
    return next((im for im in inputs.images if im.start < limit < im.start + im.num_tokens), None)
