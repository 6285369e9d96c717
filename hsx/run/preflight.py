"""Checks of a run's inputs that need no weights, made before anything heavy is imported or loaded.

A mistake a user can see from the command line, the model's ``config.json`` or the dataset's
header should cost a second, not a model load: :func:`check_extract` reads only small files
(``config.json``, a Parquet footer, a CSV header, the start of a JSON-lines file, a saved
dataset's ``dataset_info.json``, the output's manifest) and imports neither torch nor
transformers nor datasets.

How a model is named (:func:`looks_local`): a string that exists, starts with ``/``, ``.`` or
``~``, has more than one ``/``, or is ``dir/name`` with ``dir`` here is a local path, and must be a
model directory (``config.json``, weights, tokenizer files). Anything else may be a hub id
(``name`` or ``org/name``): when the hub cannot be reached (or ``HF_HUB_OFFLINE`` is set) the
process goes offline, so a hub id is read from the local Hugging Face cache or fails at once,
instead of after the hub client's retries.
"""

from __future__ import annotations

import csv
import difflib
import errno
import functools
import json
import os
import re
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

from hsx.config import ExtractConfig
from hsx.data.files import FILE_BUILDERS, check_has_rows
from hsx.data.stored import adopt_source
from hsx.engine.registry import check_engine
from hsx.errors import HsxError
from hsx.run.output import check_foreign, config_refusal
from hsx.storage.lock import unwritable
from hsx.shards.manifest import load_manifest, manifest_config_hash, manifest_path
from hsx.storage.store import as_path, is_remote

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
SCAN_BYTES = 16 << 20  # a JSON(-lines) file is scanned for its columns up to this size
PROBE_TIMEOUT_S = 2.0


def check_extract(cfg: ExtractConfig, overwrite: bool = False) -> ExtractConfig:
    """Refuse, before any weight loads, what the config, the models' ``config.json``, the dataset's
    columns and the output directory already show to be wrong; over an hsx output's tokens, the
    options that do not apply or differ from that output's (:func:`hsx.data.stored.adopt_source`).
    Returns the config the run goes on with: the source's fields adopted, validated."""
    cfg = adopt_source(cfg).validate()
    target = model_config(cfg.model, "--model", tokenizer=True)
    draft = model_config(cfg.draft_model, "--draft-model", tokenizer=False) if cfg.draft_model else None
    if target is not None:
        if not getattr(target, "model_type", None) and not getattr(target, "auto_map", None):
            raise HsxError(f"--model {cfg.model!r}: its config.json has no model_type, so transformers cannot "
                           "tell which model class to build")
        check_layers(cfg, target, draft is not None)
        check_max_length(cfg, target)
    check_dataset(cfg)
    check_output(cfg, overwrite)
    check_engine(cfg)  # last: it imports the engine's runner (and torch)
    return cfg


# --------------------------------------------------------------------------- models

def looks_local(name: str) -> bool:
    """A path, not a hub id: it exists, starts with ``/``, ``.`` or ``~``, has more than one ``/``, is
    no valid hub id, or is ``dir/name`` where ``dir`` exists here (a mistyped relative path)."""
    path = Path(name).expanduser()
    return path.exists() or name.startswith((os.sep, ".", "~")) or name.count("/") > 1 \
        or not HUB_ID.match(name) or ("/" in name and path.parent.is_dir())


def model_config(name: str, what: str, tokenizer: bool = True) -> SimpleNamespace | None:
    """The ``config.json`` of the model ``name`` (attributes, nested), after checking that it is a
    model directory; None for a hub id that will be downloaded (nothing local to check)."""
    if looks_local(name):
        return _read_config(_model_dir(name, what, tokenizer))
    offline = hub_offline()  # first: a cached model must load offline too when the hub is out of reach
    cached = _cached_hub_file(name, "config.json")
    if cached is not None:
        return _read_config(Path(cached))
    if offline:
        raise HsxError(f"{what} {name!r}: no such local directory, and as a hub id it is not in the local "
                       f"Hugging Face cache while {offline}; pass the path of a model directory "
                       "(config.json, weights, tokenizer files)")
    return None


def _model_dir(name: str, what: str, tokenizer: bool) -> Path:
    path = Path(name).expanduser()
    if not path.exists():
        hint = _close_match(path)
        raise HsxError(f"{what} {name!r}: no such directory" + (f" (did you mean {hint}?)" if hint else ""))
    if not path.is_dir():
        parent = " (pass the directory holding it)" if path.name == "config.json" or path.suffix in (".safetensors", ".bin") else ""
        raise HsxError(f"{what} {name!r} is a file; expected a model directory{parent}")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(any(path.glob(p)) for p in WEIGHTS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if tokenizer and not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    if missing:
        found = sorted(p.name for p in path.iterdir())
        has = f"it holds {found[:8]}{' ...' if len(found) > 8 else ''}" if found else "it is empty"
        raise HsxError(f"{what} {name!r} is not a model directory: no {'; no '.join(missing)} ({has})")
    return path / "config.json"


def _close_match(path: Path) -> str | None:
    parent = path.parent
    if not parent.is_dir():
        return None
    names = [p.name for p in parent.iterdir() if p.is_dir()]
    match = difflib.get_close_matches(path.name, names, n=1)
    return str(parent / match[0]) if match else None


def _read_config(path: Path) -> SimpleNamespace:
    try:
        return json.loads(path.read_text(), object_hook=lambda d: SimpleNamespace(**d))
    except (OSError, ValueError) as e:
        raise HsxError(f"{path}: not a readable JSON model config ({e})") from None


def check_layers(cfg: ExtractConfig, config: SimpleNamespace, has_draft: bool) -> None:
    """``--layers`` against the model's block count. ``eagle3`` is checked here only with explicit
    ids, or without a draft (whose config may name the ids: the engine checks those)."""
    from hsx.align.layers import ModelShape, parse_layers

    try:
        shape = ModelShape.from_config(config)
    except (AttributeError, TypeError, ValueError):
        return  # a config without the usual fields: the engine's own reading decides
    items = [s.strip() for s in cfg.layers.split(",")]
    if has_draft and cfg.eagle3_layer_ids is None:
        items = [s for s in items if s != "eagle3"]
    if any(items):
        parse_layers(",".join(items), shape, cfg.eagle3_layer_ids)


def check_max_length(cfg: ExtractConfig, config: SimpleNamespace) -> None:
    text = getattr(config, "text_config", None) or config
    positions = getattr(text, "max_position_embeddings", None)
    if cfg.max_length is not None and isinstance(positions, int) and cfg.max_length > positions:
        raise HsxError(f"--max-length {cfg.max_length} is longer than the model's context "
                       f"(max_position_embeddings {positions} in {cfg.model}/config.json)")


# --------------------------------------------------------------------------- the hub

def _env_offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.cache
def hub_offline() -> str | None:
    """Why the hub cannot be used (None: it can). One short TCP connect; when it fails the process
    goes offline (``HF_HUB_OFFLINE``), so the hub client reads its cache instead of retrying for a minute."""
    if _env_offline():
        return "HF_HUB_OFFLINE is set"
    host, port = _endpoint()
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        return None
    except OSError as e:
        os.environ["HF_HUB_OFFLINE"] = "1"  # for this process's hub client and the processes it starts
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:  # already imported: it read the variable at import
            constants.HF_HUB_OFFLINE = True
        return f"{host}:{port} cannot be reached ({e.strerror or e})"


def _cached_hub_file(repo_id: str, filename: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return found if isinstance(found, str) else None


# --------------------------------------------------------------------------- the dataset

def check_dataset(cfg: ExtractConfig) -> None:
    """The split and the columns the renderer needs, where a small read shows them; a hub name
    only makes the process go offline when the hub cannot be reached."""
    from hsx.data.render import row_shapes

    path = Path(cfg.dataset).expanduser()
    if not path.exists():
        if looks_local(cfg.dataset) or Path(cfg.dataset).suffix.lower() in (".json", ".jsonl", ".parquet", ".csv"):
            raise HsxError(f"dataset {cfg.dataset!r}: no such file or directory")
        hub_offline()
        return
    builder = FILE_BUILDERS.get(path.suffix.lower()) if path.is_file() else None
    if builder is not None:
        check_has_rows(path, builder)
    columns = dataset_columns(path, cfg.dataset, cfg.split)
    if columns is not None:
        row_shapes(columns, cfg.text_field, cfg.id_field)


def dataset_columns(path: Path, source: str, split: str) -> list[str] | None:
    """All column names of ``split`` of a local dataset, or None where only a full load would tell."""
    if path.is_file():
        if split != "train":
            raise HsxError(f"dataset {source!r} has no split {split!r}; available splits: ['train']")
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_schema(path).names
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                return next(csv.reader(f), [])
        if suffix in (".json", ".jsonl"):
            return _json_columns(path)
        return None
    return _saved_columns(path, source, split)


def _json_columns(path: Path) -> list[str] | None:
    """The union of the keys of a JSON-lines file's rows (the loader makes the same union), if the
    file is small enough to scan; None for larger files and for one JSON document."""
    if path.stat().st_size > SCAN_BYTES:
        return None
    columns: dict[str, None] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                return None  # the loader names the line (or reads one JSON document)
            if not isinstance(row, dict):
                return None
            columns.update(dict.fromkeys(row))
    return list(columns)


def _saved_columns(path: Path, source: str, split: str) -> list[str] | None:
    """Columns of a ``save_to_disk`` directory, from its ``dataset_info.json``."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        except (OSError, ValueError):
            return None
        if split not in splits:
            raise HsxError(f"dataset {source!r} has no split {split!r}; available splits: {sorted(splits)}")
        path = path / split
    if not (path / "state.json").is_file():
        return None  # not written by save_to_disk: the loader infers files and splits itself
    try:
        features = json.loads((path / "dataset_info.json").read_text()).get("features")
    except (OSError, ValueError):
        return None
    return list(features) if isinstance(features, dict) else None


# --------------------------------------------------------------------------- the output

def check_output(cfg: ExtractConfig, overwrite: bool) -> None:
    """An output this process cannot write into, or holding another run's shards, is refused here as
    the run itself would refuse it."""
    if is_remote(cfg.output):  # an object store is checked when the run takes its lease
        return
    out = as_path(cfg.output)  # a local path (another scheme than s3:// is refused here)
    check_writable(out)
    check_foreign(out, overwrite)
    if overwrite or not manifest_path(out).is_file():
        return
    # the head only (one small file): the run reads the whole manifest once, under its lock; here the
    # rest is read only when the config differs, to tell whether any shard would be lost
    if manifest_config_hash(out) == cfg.fingerprint():
        return
    m = load_manifest(out)
    if m.shards and m.config_hash != cfg.fingerprint():
        raise config_refusal(out, m, cfg)


def check_writable(out: Path) -> None:
    """``out``, or the nearest existing directory above it, where the run would create it, is a
    directory this process may write into (not a file, not on a read-only mount, permitted)."""
    base = out
    while not base.exists() and base.parent != base:
        base = base.parent
    if not base.is_dir():
        raise unwritable(out, f"{'it' if base == out else base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        reason = os.strerror(errno.EROFS if os.statvfs(base).f_flag & os.ST_RDONLY else errno.EACCES)
        raise unwritable(out, reason if base == out else f"{reason} in {base}, where it would be created")
