"""Shard format v2 (and v1 for reading): the Arrow schema, the metadata blob, the raw-bytes rows.

One Parquet row per sample. Hidden-state columns are ``list<large_binary>``: one binary value
per stored row, exactly ``W * itemsize`` bytes holding the row's W values in the stored dtype,
little-endian, bit-exact (bfloat16 is kept as its 16-bit pattern; Arrow has no bfloat16). A
row's values sit back to back in the Arrow data buffer, so a block of rows is one zero-copy
``[rows, W]`` view. Parquet stores the column as BYTE_ARRAY pages in DELTA_LENGTH_BYTE_ARRAY
encoding (the equal lengths pack into a few bytes, the data stays contiguous) with one
repetition level per row, not per float, which is why it writes and reads at close to disk
speed, and why pandas reads it (as bytes) where it cannot read v1's
``list<fixed_size_binary>`` (docs/FORMAT.md).
"""

from __future__ import annotations

import json
from typing import Mapping

import numpy as np
import pyarrow as pa
import torch
import xxhash

from hsx.errors import HsxError, ShardError
from hsx.shards import positions
from hsx.shards.readonly import read_only

FORMAT_VERSION = 3  # 3: manifest entries list each sample's source_index (shards as in 2)
READABLE_VERSIONS = (1, 2, 3)
METADATA_KEY = b"hsx"
# xxh3-64 of the metadata bytes: Parquet footers carry no checksum, so the metadata checks itself.
METADATA_CHECKSUM_KEY = b"hsx.xxh3_64"

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

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

# Which positions a sample's rows cover, by mode: row j is position j in both.
COVERS = {"generate": "0..N-2", "prefill": "0..N-1"}


def itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=dtype_of(dtype_name)).element_size()


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ShardError(f"unknown hidden-state dtype {name!r}; expected one of {sorted(DTYPES)}") from None


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
    except (KeyError, TypeError, ValueError, pa.ArrowException, HsxError) as e:
        raise ShardError(f"{where}: malformed hsx metadata ({type(e).__name__}: {e})") from None
    return meta


def encode_rows(parts: list[torch.Tensor], width: int, dtype: torch.dtype) -> pa.ChunkedArray:
    """``[rows_i, W]`` tensors (one per sample) -> a ``list<large_binary>`` column, one chunk per sample.

    Each chunk wraps its tensor's bytes as they are (no copy, no conversion: the bit pattern); the
    Parquet writer streams the chunks into one row group. Concatenating first would cost a full
    extra pass over fresh memory, which on this kind of machine halved the write speed.
    """
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    kind = pa.list_(pa.large_binary())
    chunks = []
    for p in parts:
        if p.dtype != dtype or p.dim() != 2 or p.shape[1] != width:
            raise ShardError(f"hidden rows of shape {tuple(p.shape)} {p.dtype}; column expects [rows, {width}] {dtype}")
        rows = p.shape[0]
        raw = p.contiguous().view(torch.uint8).numpy().reshape(-1) if rows else np.zeros(0, np.uint8)
        offsets = np.arange(rows + 1, dtype=np.int64) * nbytes
        values = pa.Array.from_buffers(pa.large_binary(), rows, [None, pa.py_buffer(offsets), pa.py_buffer(raw)])
        chunks.append(pa.ListArray.from_arrays(pa.array(np.array([0, rows], dtype=np.int32)), values))
    return pa.chunked_array(chunks, type=kind)


def rows_view(column: pa.ListArray, index: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Sample ``index`` of a hidden column chunk as a ``[rows, W]`` tensor sharing the Arrow buffer."""
    start, stop = column.offsets[index].as_py(), column.offsets[index + 1].as_py()
    return block_view(column.values, start, stop, width, dtype)


def block_view(values: pa.Array, start: int, stop: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[start, stop)`` of a column's values as a zero-copy, read-only ``[rows, W]`` tensor.

    ``values`` is ``large_binary`` (version 2: every value must be one row long) or
    ``fixed_size_binary`` (version 1).
    """
    row_bytes = width * torch.empty((), dtype=dtype).element_size()
    rows = stop - start
    if pa.types.is_fixed_size_binary(values.type):
        if values.type.byte_width != row_bytes:
            raise ShardError(f"column stores {values.type.byte_width}-byte rows; metadata says {width} x {dtype}")
        buf, offset = values.buffers()[1], (values.offset + start) * row_bytes
    else:
        # Every value's length was checked when the shard was loaded (check_row_bytes): the span
        # of the block is enough here.
        offs = _value_offsets(values)[start:stop + 1]
        if rows and int(offs[-1] - offs[0]) != rows * row_bytes:
            raise ShardError(f"rows {start}..{stop - 1} span {int(offs[-1] - offs[0])} bytes; metadata says "
                             f"{rows} x {width} x {dtype} = {rows * row_bytes}")
        buf, offset = values.buffers()[2], int(offs[0]) if rows else 0
    if rows == 0:
        return read_only(torch.empty((0, width), dtype=dtype))
    t = _frombuffer(buf, dtype, rows * width, offset)
    return read_only(t.view(rows, width))


def _value_offsets(values: pa.Array) -> np.ndarray:
    """The int64 value offsets of a ``large_binary`` array (zero-copy)."""
    return np.frombuffer(values.buffers()[1], dtype=np.int64, count=len(values) + 1, offset=values.offset * 8)


def check_row_bytes(table: pa.Table, meta: Mapping, where: str) -> None:
    """Every stored row of every hidden column is ``width * itemsize`` bytes long (version 2).

    Version 1 types carry the width (``fixed_size_binary``) and were checked with the schema.
    """
    if meta.get("format_version") == 1:
        return
    for g in meta["layers"]:
        row_bytes = g["width"] * itemsize(meta["dtype"])
        for chunk in table.column(g["name"]).chunks:
            lengths = np.diff(_value_offsets(chunk.values)[chunk.offsets[0].as_py():chunk.offsets[-1].as_py() + 1]) if len(chunk) else ()
            bad = np.flatnonzero(np.asarray(lengths) != row_bytes)
            if len(bad):
                raise ShardError(f"{where}: column {g['name']!r} has a {int(lengths[bad[0]])}-byte row; metadata "
                                 f"says width {g['width']} x {meta['dtype']} = {row_bytes} bytes per row")


def _frombuffer(buf: pa.Buffer, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        # torch warns that the Arrow buffer is not writable; block_view wraps the view in a
        # ReadOnlyTensor, which refuses in-place writes.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


# Config keys that name where or how a model was loaded rather than what it is.
_NOT_THE_MODEL = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash",
                  "_attn_implementation_autoset", "attn_implementation", "_attn_implementation")


def config_sha256(model_config) -> str:
    """``model.config_sha256``: the config's JSON without the keys that change with the checkout or the
    library (path, transformers version, load dtype, attention implementation), so shards made by
    different engines, hosts or transformers releases from the same model record the same hash."""
    import hashlib
    import json

    cfg = {k: v for k, v in model_config.to_dict().items() if k not in _NOT_THE_MODEL}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_metadata(*, layers: list[dict], dtype: str, mode: str, model: dict | None = None,
                   tokenizer: dict | None = None, engine: dict | None = None, speculative: dict | None = None,
                   dataset: dict | None = None, keep: str = "all", **extra) -> dict:
    """The metadata blob every shard and the manifest carry (docs/FORMAT.md lists the fields)."""
    from hsx import __version__

    dtype_of(dtype)
    if mode not in COVERS:
        raise ShardError(f"unknown mode {mode!r}; expected one of {sorted(COVERS)}")
    positions.check_rule(keep, mode)
    return {
        "format_version": FORMAT_VERSION,
        "hsx_version": __version__,
        "mode": mode,
        "dtype": dtype,
        "layers": [{**g, "dtype": dtype, "row_bytes": g["width"] * itemsize(dtype)} for g in layers],
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
