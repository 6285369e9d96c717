"""Shard format v1: the Arrow schema, the metadata blob, and the raw-bytes encoding of hidden rows.

One Parquet row per sample. Hidden-state columns are ``list<fixed_size_binary(W * itemsize)>``:
one fixed-width binary per covered token position holding the row's W values in the stored
dtype, little-endian, bit-exact (bfloat16 is kept as its 16-bit pattern; Arrow has no bfloat16).
Parquet stores such a column as FIXED_LEN_BYTE_ARRAY pages with one repetition level per row,
not per float, which is why it writes and reads at close to disk speed (docs/FORMAT.md).
"""

from __future__ import annotations

import json
from typing import Mapping

import numpy as np
import pyarrow as pa
import torch
import xxhash

from hsx.errors import ShardError

FORMAT_VERSION = 1
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


def hidden_type(width: int, dtype_name: str) -> pa.DataType:
    return pa.list_(pa.binary(width * itemsize(dtype_name)))


def schema_for(metadata: Mapping) -> pa.Schema:
    """The full schema of a shard described by ``metadata`` (its layer groups and dtype)."""
    fields = list(BASE_FIELDS)
    for g in metadata["layers"]:
        fields.append(pa.field(g["name"], hidden_type(g["width"], metadata["dtype"]), nullable=False))
    blob = json.dumps(metadata, sort_keys=True).encode()
    return pa.schema(fields, metadata={METADATA_KEY: blob, METADATA_CHECKSUM_KEY: xxhash.xxh3_64_hexdigest(blob).encode()})


def expected_rows(num_tokens: np.ndarray, mode: str) -> np.ndarray:
    """Rows a sample of ``num_tokens`` tokens must have under the alignment convention."""
    if mode == "generate":
        return np.maximum(num_tokens - 1, 0)
    if mode == "prefill":
        return num_tokens
    raise ShardError(f"unknown mode {mode!r} in shard metadata; expected one of {sorted(COVERS)}")


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
    if version != FORMAT_VERSION:
        raise ShardError(f"{where}: shard format version {version!r}; this hsx reads version {FORMAT_VERSION}")
    try:
        # Readers index these fields without further checks: a shard whose metadata lacks them
        # (or holds values of the wrong kind) is rejected here, with the file named.
        schema_for(meta)
        expected_rows(np.zeros(0, dtype=np.int64), meta["mode"])
    except (KeyError, TypeError, ValueError, pa.ArrowException, ShardError) as e:
        raise ShardError(f"{where}: malformed hsx metadata ({type(e).__name__}: {e})") from None
    return meta


def encode_rows(parts: list[torch.Tensor], width: int, dtype: torch.dtype) -> pa.ChunkedArray:
    """``[rows_i, W]`` tensors (one per sample) -> a ``list<fixed_size_binary>`` column, one chunk per sample.

    Each chunk wraps its tensor's bytes as they are (no copy, no conversion: the bit pattern); the
    Parquet writer streams the chunks into one row group. Concatenating first would cost a full
    extra pass over fresh memory, which on this kind of machine halved the write speed.
    """
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    kind = pa.list_(pa.binary(nbytes))
    chunks = []
    for p in parts:
        if p.dtype != dtype or p.dim() != 2 or p.shape[1] != width:
            raise ShardError(f"hidden rows of shape {tuple(p.shape)} {p.dtype}; column expects [rows, {width}] {dtype}")
        rows = p.shape[0]
        raw = p.contiguous().view(torch.uint8).numpy().reshape(-1) if rows else np.zeros(0, np.uint8)
        values = pa.FixedSizeBinaryArray.from_buffers(pa.binary(nbytes), rows, [None, pa.py_buffer(raw)])
        chunks.append(pa.ListArray.from_arrays(pa.array(np.array([0, rows], dtype=np.int32)), values))
    return pa.chunked_array(chunks, type=kind)


def rows_view(column: pa.ListArray, index: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Sample ``index`` of a hidden column chunk as a ``[rows, W]`` tensor sharing the Arrow buffer."""
    start, stop = column.offsets[index].as_py(), column.offsets[index + 1].as_py()
    return block_view(column.values, start, stop, width, dtype)


def block_view(values: pa.FixedSizeBinaryArray, start: int, stop: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[start, stop)`` of a fixed-size-binary array as a zero-copy ``[rows, W]`` tensor."""
    item = torch.empty((), dtype=dtype).element_size()
    if values.type.byte_width != width * item:
        raise ShardError(f"column stores {values.type.byte_width}-byte rows; metadata says {width} x {dtype}")
    rows = stop - start
    if rows == 0:
        return torch.empty((0, width), dtype=dtype)
    buf = values.buffers()[1]
    offset = (values.offset + start) * values.type.byte_width
    t = _frombuffer(buf, dtype, rows * width, offset)
    return t.view(rows, width)


def _frombuffer(buf: pa.Buffer, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        # Arrow buffers are immutable; torch warns that the tensor is not writable. The views are
        # documented as read-only (clone to modify).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def build_metadata(*, layers: list[dict], dtype: str, mode: str, model: dict | None = None,
                   tokenizer: dict | None = None, engine: dict | None = None, speculative: dict | None = None,
                   dataset: dict | None = None, **extra) -> dict:
    """The metadata blob every shard and the manifest carry (docs/FORMAT.md lists the fields)."""
    from hsx import __version__

    dtype_of(dtype)
    if mode not in COVERS:
        raise ShardError(f"unknown mode {mode!r}; expected one of {sorted(COVERS)}")
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
        "model": model or {},
        "tokenizer": tokenizer or {},
        "engine": engine or {},
        "speculative": speculative,
        "dataset": dataset or {},
        **extra,
    }
