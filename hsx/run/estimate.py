"""``hsx extract --dry-run``: what a run will write, from its configuration alone, before any forward.

The model's ``config.json`` gives the widths of the layer groups, the tokenizer and the dataset give
every sample's tokens (rendered exactly as the run renders them), the ``keep`` rule gives the rows,
and the codec's measured ratio gives the bytes. Nothing is loaded onto a device and no forward runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hsx.config import ExtractConfig
from hsx.errors import HsxError, SampleError
from hsx.run.report import ERRORS_SHOWN, size_text
from hsx.shards import positions
from hsx.shards.format import row_bytes as stored_row_bytes
from hsx.shards.sink import DEFAULT_LANES, ROW_GROUP_BYTES

# Compressed / raw bytes of the hidden columns, per codec, measured on SmolLM2-135M-Instruct states
# (final,eagle3 in bf16, the demo chats in prefill; scripts/bench_format.py, docs/STORAGE.md).
CODEC_RATIO = {"none": 1.0, "zstd": 0.62, "planes-zstd": 0.557}
RATIO_SOURCE = "SmolLM2-135M final+eagle3 bf16, demo chats (docs/STORAGE.md)"
# the base columns (input_ids, loss_mask, positions, zstd) and the Parquet footers: 5.2 bytes a token measured
BASE_BYTES_PER_TOKEN = 5.2


@dataclass
class Estimate:
    samples: int
    skipped: int  # rows that would be recorded as errors (they cannot be rendered)
    tokens: int  # prompt tokens (generate mode: plus up to max_new_tokens each, see ``upper_bound``)
    rows: int  # stored rows per hidden column
    raw_bytes: int  # hidden-state bytes before the codec
    bytes: int  # bytes on disk, hidden columns at the codec's measured ratio plus the base columns
    shards: int
    columns: dict[str, int]  # column -> width
    codec: str
    upper_bound: bool  # generate mode: every completion assumed max_new_tokens long
    errors: list[dict] = field(default_factory=list)  # the would-be error records: sample_id, source_index, reason

    def lines(self) -> list[str]:
        bound = "at most " if self.upper_bound else ""
        return [
            f"samples  {self.samples:,} ({self.skipped:,} would be error records)",
            *self._error_lines(),
            f"tokens   {bound}{self.tokens:,}; rows per column {bound}{self.rows:,}",
            "columns  " + ", ".join(f"{n} ({w} wide)" for n, w in self.columns.items()),
            f"hidden   {bound}{size_text(self.raw_bytes)} raw",
            f"on disk  {bound}{size_text(self.bytes)} with --compression {self.codec} "
            f"(x{CODEC_RATIO[self.codec]:.2f} of raw, measured on {RATIO_SOURCE}; real ratios vary with the model and data)",
            f"shards   {bound}{self.shards:,}",
        ]

    def _error_lines(self) -> list[str]:
        """Each would-be error record as ``hsx inspect`` lists them (the first :data:`ERRORS_SHOWN`)."""
        lines = [f"  error  {e['sample_id']}  (source row {e['source_index']}): {e['reason']}"
                 for e in self.errors[:ERRORS_SHOWN]]
        if len(self.errors) > ERRORS_SHOWN:
            lines.append(f"  ... and {len(self.errors) - ERRORS_SHOWN} more error records")
        return lines


def _vision_of(cfg: ExtractConfig, model_config, tokenizer):
    """A vision-language target's ``(VisionSpec, image processor)`` for the renderer (images are read and
    expanded as the run will), else None."""
    if getattr(model_config, "vision_config", None) is None:
        return None
    from transformers import AutoImageProcessor

    from hsx.data.images import VisionSpec

    try:
        processor = AutoImageProcessor.from_pretrained(cfg.model, backend="pil", trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise HsxError(f"{cfg.model}: cannot read the model's image processor ({e})") from None
    return VisionSpec.of(model_config, tokenizer, processor), processor


def estimate(cfg: ExtractConfig) -> Estimate:
    """Tokens, rows, bytes and shards the run ``cfg`` will write (module docstring)."""
    from transformers import AutoConfig, AutoTokenizer

    from hsx.align import ModelShape, parse_layers
    from hsx.data.load import load_rows
    from hsx.data.render import Renderer
    from hsx.data.stored import adopt_source

    cfg = adopt_source(cfg).validate()  # over an hsx output's tokens: its mode, keep and max_new_tokens
    if cfg.compression not in CODEC_RATIO:
        raise HsxError(f"no measured ratio for codec {cfg.compression!r}; known: {sorted(CODEC_RATIO)}")
    try:
        model_config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise HsxError(f"{cfg.model}: cannot read the model's config or tokenizer ({e})") from None
    vision = _vision_of(cfg, model_config, tokenizer)
    text_config = model_config.get_text_config(decoder=True)
    groups = parse_layers(cfg.layers, ModelShape.from_config(text_config), cfg.eagle3_layer_ids)
    rows_all = load_rows(cfg.dataset, cfg.split)
    data = rows_all.select(range(min(cfg.limit, len(rows_all)))) if cfg.limit is not None else rows_all
    context = getattr(text_config, "max_position_embeddings", None)
    chat_template = open(cfg.chat_template).read() if cfg.chat_template else None
    renderer = Renderer(tokenizer, cfg.mode, text_field=cfg.text_field, id_field=cfg.id_field,
                        chat_template=chat_template, max_length=cfg.max_length or context, split=cfg.split,
                        vision=vision)
    renderer.detect(data.column_names)
    n_tok, prompt, masks, errors = [], [], [], []
    for i, row in enumerate(data):
        try:
            p = renderer.render(row, i)
        except SampleError as e:
            errors.append({"sample_id": e.sample_id, "source_index": i, "reason": e.reason})
            continue
        n = len(p.input_ids) + (cfg.max_new_tokens if cfg.mode == "generate" else 0)
        n_tok.append(n)
        prompt.append(len(p.input_ids) if cfg.mode == "generate" else n)
        # generate mode: completion tokens are learned (loss 1), as the pipeline marks them
        masks.append(np.concatenate([np.asarray(p.loss_mask, np.uint8), np.ones(n - len(p.input_ids), np.uint8)]))
    n_tok_a = np.asarray(n_tok, np.int64)
    offsets = np.concatenate([[0], np.cumsum(n_tok_a)])
    mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
    rows = positions.stored_rows(cfg.keep, cfg.mode, n_tok_a, np.asarray(prompt, np.int64), mask, offsets)
    row_bytes = sum(stored_row_bytes(g.width, cfg.dtype) for g in groups)
    raw = int(rows.sum()) * row_bytes
    on_disk = int(raw * CODEC_RATIO[cfg.compression] + BASE_BYTES_PER_TOKEN * int(n_tok_a.sum()))
    # the writer cuts shards by the records' (raw) bytes; with several lanes each shard is one row group
    lanes = cfg.writer_lanes or DEFAULT_LANES
    per_shard = min(cfg.max_shard_mb << 20, ROW_GROUP_BYTES) if lanes > 1 else cfg.max_shard_mb << 20
    shards = max(math.ceil(raw / per_shard), math.ceil(len(n_tok) / cfg.max_shard_samples)) if n_tok else 0
    return Estimate(len(n_tok), len(errors), int(n_tok_a.sum()), int(rows.sum()), raw, on_disk, shards,
                    {g.name: g.width for g in groups}, cfg.compression, cfg.mode == "generate", errors)
