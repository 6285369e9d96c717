"""Shard format v8 (and v1-v7 for reading): the Arrow schema, the metadata blob, a long sample's pieces.

One Parquet row per sample, or per piece of a long sample (version 6): a sample whose rows would
take more than ``PIECE_BYTES`` in a column is cut into pieces of consecutive rows, one Parquet row
(and one row group) each, in order, every piece carrying the sample's whole token columns, its own
``positions`` and ``first_row`` (the index of its first row among the sample's; 0 on the first
piece). A Parquet page holds whole rows and a BYTE_ARRAY page or value at most 2 GiB, so one cell
must stay well below that; readers join a sample's pieces back (:func:`join_pieces`). How the
hidden-state cells hold a sample's rows (the codecs' two layouts, the lossy dtypes) is
:mod:`hsx.shards.cells`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import torch
import xxhash

from hsx.errors import HsxError, ShardError
from hsx.shards import positions, quant

FORMAT_VERSION = 8  # 8: image columns of vision-language runs (VISION_FIELDS, metadata "vision"); 7: manifest as head, segments and commit log; shards fanned out 4,096 a folder; 6: long samples in pieces (first_row); 5: lossy dtypes; 4: codec (planes layout), positions column, hidden manifest and staged shards
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
# A piece's stored bytes in its widest column, at most: Parquet keeps a row in one page, and a page
# (like a BYTE_ARRAY value) has a 32-bit size.
PIECE_BYTES = 64 << 20
# Hidden-state codecs: Parquet page compression of the hidden columns, and their cell layout.
CODECS = {"planes-zstd": ("zstd", "planes"), "zstd": ("zstd", "rows"), "none": ("none", "rows")}
DEFAULT_CODEC = "planes-zstd"
ZSTD_LEVEL = 3  # level 1 left eagle3 planes 4% larger on SmolLM2 states (docs/STORAGE.md)
METADATA_KEY = b"hsx"
# xxh3-64 of the metadata bytes: Parquet footers carry no checksum, so the metadata checks itself.
METADATA_CHECKSUM_KEY = b"hsx.xxh3_64"

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Lossy stored dtypes (version 5, hsx.shards.quant): codes plus per-group scales, read back as bfloat16.
LOSSY = tuple(quant.CODES)
READ_DTYPE_OF_LOSSY = torch.bfloat16

# Columns every shard has, in order; hidden-state columns follow.
BASE_FIELDS = [
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("source_index", pa.int64(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("prompt_len", pa.int32(), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("verify_steps", pa.int32()),
    pa.field("accept_lens", pa.list_(pa.int16())),
]
BASE_NAMES = [f.name for f in BASE_FIELDS]
# Version 4: the token position of each stored row (what ``keep`` selected), for readers without hsx.
POSITIONS = pa.field("positions", pa.list_(pa.int32()), nullable=False)
# Version 6: which of its sample's rows a Parquet row's first hidden row is (0: the sample's first piece).
FIRST_ROW = pa.field("first_row", pa.int64(), nullable=False)

# Version 8, shards of a vision-language target (metadata "vision" set) only: per token, 1 on image tokens;
# per image, where it came from, its pixel hash, size, grid and token block; mRoPE models' positions of
# every token, axis-major ([t..., h..., w...], 3 x N values; null on other models) and rope_delta.
IMAGE_MASK = pa.field("image_mask", pa.list_(pa.uint8()), nullable=False)
IMAGES = pa.field("images", pa.list_(pa.struct([
    pa.field("source", pa.string()), pa.field("sha256", pa.string()), pa.field("width", pa.int32()),
    pa.field("height", pa.int32()), pa.field("grid", pa.list_(pa.int32())), pa.field("start", pa.int32()),
    pa.field("num_tokens", pa.int32())])), nullable=False)
MROPE_POSITIONS = pa.field("mrope_positions", pa.list_(pa.int32()))
ROPE_DELTA = pa.field("rope_delta", pa.int32())
VISION_FIELDS = [IMAGE_MASK, IMAGES, MROPE_POSITIONS, ROPE_DELTA]

# Which positions a sample's rows cover, by mode: row j is position j in both.
COVERS = {"generate": "0..N-2", "prefill": "0..N-1"}


def itemsize(dtype_name: str) -> int:
    """Stored bytes per value (a lossy dtype's scales come on top: :func:`row_bytes`)."""
    return 1 if dtype_name in LOSSY else torch.empty((), dtype=dtype_of(dtype_name)).element_size()


def row_bytes(width: int, dtype_name: str) -> int:
    """Stored bytes of one row of ``width`` values, scales included."""
    if dtype_name in LOSSY:
        return width + quant.groups(width) * 2
    return width * itemsize(dtype_name)


def dtype_of(name: str) -> torch.dtype:
    """The dtype readers give a column stored as ``name`` (bfloat16 for the lossy dtypes)."""
    if name in LOSSY:
        return READ_DTYPE_OF_LOSSY
    try:
        return DTYPES[name]
    except KeyError:
        raise ShardError(f"unknown hidden-state dtype {name!r}; expected one of {sorted(DTYPES) + list(LOSSY)}") from None


def hidden_type(width: int, dtype_name: str, version: int = FORMAT_VERSION) -> pa.DataType:
    if version == 1:
        return pa.list_(pa.binary(width * itemsize(dtype_name)))
    return pa.list_(pa.large_binary())


def keep_of(metadata: Mapping) -> str:
    """Which positions the shard stores rows for (version 1 shards store every covered position)."""
    return metadata.get("keep", "all")


def schema_for(metadata: Mapping) -> pa.Schema:
    """The full schema of a shard described by ``metadata`` (its version, layer groups and dtype)."""
    fields = list(BASE_FIELDS)
    version = metadata.get("format_version", FORMAT_VERSION)
    if version >= 4:
        fields.append(POSITIONS)
    if version >= 6:
        fields.append(FIRST_ROW)
    if version >= 8 and metadata.get("vision"):
        fields.extend(VISION_FIELDS)
    for g in metadata["layers"]:
        fields.append(pa.field(g["name"], hidden_type(g["width"], metadata["dtype"], version), nullable=False))
    blob = json.dumps(metadata, sort_keys=True).encode()
    return pa.schema(fields, metadata={METADATA_KEY: blob, METADATA_CHECKSUM_KEY: xxhash.xxh3_64_hexdigest(blob).encode()})


def expected_rows(num_tokens: np.ndarray, mode: str) -> np.ndarray:
    """Rows the engine covers for a sample of ``num_tokens`` tokens (before ``keep`` selects)."""
    if mode not in COVERS:
        raise ShardError(f"unknown mode {mode!r} in shard metadata; expected one of {sorted(COVERS)}")
    return positions.covered_rows(num_tokens, mode)


def read_metadata(schema: pa.Schema, where: str) -> dict:
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ShardError(f"{where}: no hsx metadata in the Parquet footer; not an hsx shard")
    digest = (schema.metadata or {}).get(METADATA_CHECKSUM_KEY)
    if digest != xxhash.xxh3_64_hexdigest(raw).encode():
        raise ShardError(f"{where}: hsx metadata does not match its checksum {digest!r} (corrupt footer)")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise ShardError(f"{where}: hsx metadata is not valid JSON ({e})") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version not in READABLE_VERSIONS:
        raise ShardError(f"{where}: shard format version {version!r}; this hsx reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    try:
        # Readers index these fields without further checks: a shard whose metadata lacks them
        # (or holds values of the wrong kind) is rejected here, with the file named.
        schema_for(meta)
        dtype_of(meta["dtype"])
        expected_rows(np.zeros(0, dtype=np.int64), meta["mode"])
        positions.check_rule(keep_of(meta), meta["mode"], "keep")
        codec_of(meta)
        if meta["dtype"] in LOSSY and version < 5:
            raise ShardError(f"dtype {meta['dtype']!r} is lossy, which version {version} shards do not have")
    except (KeyError, TypeError, ValueError, pa.ArrowException, HsxError) as e:
        raise ShardError(f"{where}: malformed hsx metadata ({type(e).__name__}: {e})") from None
    return meta


def codec_of(metadata: Mapping) -> str:
    """The hidden-state codec of a shard (shards before version 4 are ``none``: raw rows)."""
    codec = metadata.get("codec", "none")
    if codec not in CODECS:
        raise ShardError(f"unknown hidden-state codec {codec!r}; expected one of {sorted(CODECS)}")
    return codec


def sample_starts(table: pa.Table) -> np.ndarray | None:
    """The Parquet rows of a table that begin a sample (``first_row`` 0); None when every row is a whole sample."""
    if FIRST_ROW.name not in table.column_names:
        return None
    first = table.column(FIRST_ROW.name).to_numpy()
    return np.flatnonzero(first == 0) if first.any() else None


def join_pieces(table: pa.Table, metadata: Mapping, where: str) -> pa.Table:
    """One row per sample: each long sample's pieces joined into one row (its hidden cells' values and its
    positions chained in order, every other column from its first piece), ``first_row`` 0 throughout.

    Whole samples stay views of the table's buffers; only the pieces of long samples are copied.
    """
    starts = sample_starts(table)
    if starts is None:
        return table
    if starts[:1].tolist() != [0]:
        raise ShardError(f"{where}: the first row is a piece of a sample that starts in another shard "
                         f"(first_row {table.column(FIRST_ROW.name)[0].as_py()})")
    ends = np.append(starts[1:], table.num_rows)
    _check_pieces(table, starts, ends, where)
    chained = {POSITIONS.name, *(g["name"] for g in metadata["layers"])}
    parts, at = [], 0  # runs of whole samples (views) and joined long samples, chunked alike in every column
    for j in np.flatnonzero(ends - starts > 1):
        a, b = int(starts[j]), int(ends[j])
        if a > at:
            parts.append(table.slice(at, a - at))
        pieces = table.slice(a, b - a)
        parts.append(pa.Table.from_arrays([_chain(pieces.column(name)) if name in chained else
                                           pa.array([0], pa.int64()) if name == FIRST_ROW.name else
                                           pieces.column(name).slice(0, 1).combine_chunks()
                                           for name in table.column_names], schema=table.schema))
        at = b
    if at < table.num_rows:
        parts.append(table.slice(at))
    return pa.concat_tables(parts)


def _check_pieces(table: pa.Table, starts: np.ndarray, ends: np.ndarray, where: str) -> None:
    """Each piece names its sample and starts where the pieces before it end."""
    ids = table.column("sample_id").to_numpy(zero_copy_only=False)
    owner = np.repeat(np.arange(len(starts)), ends - starts)
    bad = np.flatnonzero(ids != ids[starts][owner])
    if len(bad):
        raise ShardError(f"{where}: Parquet row {int(bad[0])} is a piece of {ids[bad[0]]!r} inside sample "
                         f"{ids[starts[owner[bad[0]]]]!r}")
    if POSITIONS.name not in table.column_names:
        return
    rows = pa.compute.list_value_length(table.column(POSITIONS.name)).to_numpy(zero_copy_only=False).astype(np.int64)
    before = np.cumsum(rows) - rows
    want = before - before[starts][owner]  # rows of the sample's earlier pieces
    got = table.column(FIRST_ROW.name).to_numpy()
    bad = np.flatnonzero(got != want)
    if len(bad):
        raise ShardError(f"{where}: a piece of sample {ids[bad[0]]!r} starts at row {int(got[bad[0]])}; its earlier "
                         f"pieces hold {int(want[bad[0]])} rows")


def _chain(col: pa.ChunkedArray) -> pa.Array:
    """A list column's rows made one list of all their values, in order (a copy)."""
    values = pa.concat_arrays([c.flatten() for c in col.chunks])
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), values, type=col.type)


# Config keys that name where or how a model was loaded rather than what it is.
_NOT_THE_MODEL = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash",
                  "_attn_implementation_autoset", "attn_implementation", "_attn_implementation")


def _model_keys(config: dict) -> dict:
    """``config`` without the load keys, in its sub-configs too (a vision-language model's ``text_config`` and
    ``vision_config`` take the load dtype when the weights load)."""
    return {k: _model_keys(v) if isinstance(v, dict) else v for k, v in config.items() if k not in _NOT_THE_MODEL}


def config_sha256(model_config) -> str:
    """``model.config_sha256``: the config's JSON without the keys that change with the checkout or the
    library (path, transformers version, load dtype, attention implementation), so shards made by
    different engines, hosts or transformers releases from the same model record the same hash."""
    import json

    cfg = _model_keys(model_config.to_dict())
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_metadata(*, layers: list[dict], dtype: str, mode: str, model: dict | None = None,
                   tokenizer: dict | None = None, engine: dict | None = None, speculative: dict | None = None,
                   dataset: dict | None = None, keep: str = "all", codec: str = DEFAULT_CODEC, **extra) -> dict:
    """The metadata blob every shard and the manifest carry (docs/FORMAT.md lists the fields)."""
    from hsx.version import __version__

    dtype_of(dtype)
    if mode not in COVERS:
        raise ShardError(f"unknown mode {mode!r}; expected one of {sorted(COVERS)}")
    positions.check_rule(keep, mode)
    codec_of({"codec": codec})
    return {
        "format_version": FORMAT_VERSION,
        "hsx_version": __version__,
        "mode": mode,
        "dtype": dtype,
        "codec": codec,
        "layers": [{**g, "dtype": dtype, "row_bytes": row_bytes(g["width"], dtype)} for g in layers],
        "layer_convention": "boundary 0 = embedding output; boundary b = output of block b-1 before the "
                            "final norm; final = output of the final norm (input of lm_head)",
        "alignment": {
            "row": "row j is the state after consuming token j (it predicts token j+1)",
            "covers": COVERS[mode],
        },
        "keep": keep,
        "model": model or {},
        "tokenizer": tokenizer or {},
        "engine": engine or {},
        "speculative": speculative,
        "dataset": dataset or {},
        **extra,
    }


def _legacy_config_sha256(config, name_or_path: str | None = None, dtype: str | None = None) -> str:
    """The hash format-1 shards record: the whole config JSON, path, load dtype and transformers version
    included; pass the recorded path and dtype to ask "is this the config that extraction saw?"."""
    import copy

    c = copy.deepcopy(config)
    if name_or_path is not None:
        c._name_or_path = name_or_path
    if dtype is not None:
        c.dtype = dtype
    return hashlib.sha256(c.to_json_string(use_diff=False).encode()).hexdigest()[:16]


def config_matches(config, recorded: dict) -> bool:
    """Whether ``config`` is the one described by a shard's ``model`` metadata (path, dtype and library aside)."""
    want = recorded.get("config_sha256")
    if not want:
        return True  # nothing recorded to compare with (hand-written shards)
    if config_sha256(config) == want:
        return True
    path = recorded.get("path")
    return any(_legacy_config_sha256(config, path, d) == want for d in (None, "float32", "bfloat16", "float16"))
