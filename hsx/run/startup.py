"""The start of every run: its rows, engine, renderer and metadata, made in one place.

``hsx extract`` (:mod:`hsx.run.pipeline`), the online feed (:mod:`hsx.run.feed`) and each Ray
worker (:mod:`hsx.run.scale.worker`) start the same way: the dataset's rows (the driver of a Ray
run opens them once and hands workers their column names and description), the engine the config
names (:func:`hsx.engine.registry.build_engine`), the renderer over the tokenizer it loaded, and
the metadata every shard of the run carries.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from hsx.config import ExtractConfig
from hsx.shards.format import build_metadata, config_sha256


@dataclass
class Started:
    """A run's engine, its renderer and the metadata of its shards."""

    engine: object
    renderer: object
    metadata: dict


def start(cfg: ExtractConfig, column_names, dataset_meta: dict) -> Started:
    """Build the engine of ``cfg`` and what depends on it, for rows with ``column_names``."""
    from hsx.engine.registry import build_engine

    engine = build_engine(cfg)
    renderer, chat_template = make_renderer(cfg, engine, column_names)
    return Started(engine, renderer, run_metadata(cfg, engine, chat_template, dataset_meta))


def open_rows(cfg: ExtractConfig):
    """The dataset rows a run covers (the first ``cfg.limit``) and the description of the whole split."""
    from hsx.data.load import describe, load_rows

    rows_all = load_rows(cfg.dataset, cfg.split)
    dataset_meta = describe(rows_all, cfg.dataset, cfg.split)  # before --limit: a resume may change it
    rows = rows_all.select(range(min(cfg.limit, len(rows_all)))) if cfg.limit is not None else rows_all
    return rows, dataset_meta


def make_renderer(cfg: ExtractConfig, engine, column_names) -> tuple:
    """The renderer for ``cfg`` over a dataset with these columns, and the chat template text (or None)."""
    from hsx.data.render import Renderer

    chat_template = Path(cfg.chat_template).read_text() if cfg.chat_template else None
    renderer = Renderer(
        engine.tokenizer, cfg.mode, text_field=cfg.text_field, id_field=cfg.id_field,
        chat_template=chat_template, max_length=cfg.max_length or engine.context_length, split=cfg.split,
        vision=getattr(engine, "vision", None),
    )
    renderer.detect(column_names)
    return renderer, chat_template


def _sha(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]


def resolved_path(given: str) -> str | None:
    """The absolute path of a local model directory (readers find it from any folder), None for a hub id."""
    path = Path(given).expanduser()
    return str(path.resolve()) if path.is_dir() else None


def _describe_model(path: str, model_config, shape) -> dict:
    return {
        "path": path,
        "resolved_path": resolved_path(path),
        "model_type": getattr(model_config, "model_type", None),
        "config_sha256": config_sha256(model_config),
        "revision": getattr(model_config, "_commit_hash", None),
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "hc_mult": shape.hc_mult,
    }


def _describe_tokenizer(cfg: ExtractConfig, tokenizer, chat_template: str | None) -> dict:
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return {
        "path": cfg.model,
        "resolved_path": resolved_path(cfg.model),
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "chat_template_sha256": _sha(template if isinstance(template, str) else json.dumps(template, sort_keys=True) if template else None),
        "chat_template_source": "file " + cfg.chat_template if cfg.chat_template else "tokenizer",
    }


def run_metadata(cfg: ExtractConfig, engine, chat_template: str | None, dataset_meta: dict) -> dict:
    """What the run's shards say about themselves (:func:`hsx.shards.format.build_metadata`)."""
    sampling = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}
    return build_metadata(
        layers=[g.describe() for g in engine.groups],
        dtype=cfg.dtype,
        mode=cfg.mode,
        model=_describe_model(cfg.model, engine.model_config, engine.shape),
        tokenizer=_describe_tokenizer(cfg, engine.tokenizer, chat_template),
        engine=engine.describe(),
        speculative=engine.describe_speculative(),
        dataset=dataset_meta,
        keep=cfg.keep,
        codec=cfg.compression,
        sampling=sampling if cfg.mode == "generate" else None,
        config_hash=cfg.fingerprint(),
        vision=engine.describe_vision() if getattr(engine, "vision", None) else None,
    )
