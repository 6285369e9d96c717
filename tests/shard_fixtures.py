"""Builders shared by the shard tests: metadata, records with chosen bit patterns, small datasets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hsx.shards import Manifest, Record, ShardSink, build_metadata

# Same-width integer type used to compare stored values bit for bit.
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Values a float round-trip through a conversion would lose or canonicalise: -0.0, +-inf,
# quiet and signalling NaNs with payloads, the smallest and largest subnormals.
SPECIAL_BITS = {
    torch.bfloat16: [0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x7F81, 0xFFFF, 0x0001, 0x807F],
    torch.float16: [0x8000, 0x7C00, 0xFC00, 0x7E01, 0x7C01, 0xFFFF, 0x0001, 0x83FF],
    torch.float32: [0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x807FFFFF],
}


def layer(name: str, width: int, source: int) -> dict:
    return {"name": name, "sources": [source], "width": width, "raw_ids": None, "rule": "test group"}


def make_metadata(widths, dtype: str = "bfloat16", mode: str = "generate", codec: str = "planes-zstd") -> dict:
    return build_metadata(
        codec=codec,
        layers=[layer(f"l{j}", w, j + 1) for j, w in enumerate(widths)],
        dtype=dtype,
        mode=mode,
        model={"path": "tiny-test-model", "num_layers": 4, "hidden_size": max(widths, default=1)},
        engine={"name": "test", "version": "0"},
        dataset={"path": "memory", "fingerprint": "abc"},
    )


def random_rows(rng: np.random.Generator, rows: int, width: int, dtype: torch.dtype, specials: bool = True) -> torch.Tensor:
    """``[rows, width]`` of random bit patterns (so NaN payloads, -0.0, inf, subnormals all occur)."""
    if dtype == torch.float32:
        bits = rng.integers(0, 2**32, size=(rows, width), dtype=np.uint32)
    else:
        bits = rng.integers(0, 2**16, size=(rows, width), dtype=np.uint16)
    flat = bits.reshape(-1)
    if specials and flat.size:
        sp = np.array(SPECIAL_BITS[dtype], dtype=bits.dtype)
        k = min(flat.size, sp.size)
        flat[:k] = sp[:k]
    signed = bits.view(np.int32 if dtype == torch.float32 else np.int16)
    return torch.from_numpy(signed.copy()).view(dtype)


def finite_rows(gen: torch.Generator, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, width, generator=gen).to(dtype)


def rows_for(n_tokens: int, mode: str) -> int:
    return max(n_tokens - 1, 0) if mode == "generate" else n_tokens


def make_record(i: int, n_tokens: int, meta: dict, hidden: dict[str, torch.Tensor], accept: torch.Tensor | None,
                prompt_len: int | None = None) -> Record:
    return Record(
        sample_id=f"s{i:03d}",
        source_index=1000 + i,
        input_ids=torch.arange(n_tokens, dtype=torch.int64) * 7 + i,
        prompt_len=min(n_tokens, 1 + i % 3) if prompt_len is None else prompt_len,
        loss_mask=torch.tensor([(i + t) % 2 for t in range(n_tokens)], dtype=torch.uint8),
        finish_reason=["stop", "length"][i % 2],
        hidden=hidden,
        accept_lens=accept,
    )


def random_records(meta: dict, tokens: list[int], accept: str, seed: int, specials: bool = True) -> list[Record]:
    """One record per entry of ``tokens``; ``accept`` is 'none', 'all' or 'mixed' (every other one)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPE_NAMES[meta["dtype"]]
    out = []
    for i, n in enumerate(tokens):
        rows = rows_for(n, meta["mode"])
        hidden = {g["name"]: random_rows(rng, rows, g["width"], dtype, specials) for g in meta["layers"]}
        has = accept == "all" or (accept == "mixed" and i % 2 == 1)
        acc = torch.from_numpy(rng.integers(1, 6, size=int(rng.integers(0, 5)), dtype=np.int16)) if has else None
        out.append(make_record(i, n, meta, hidden, acc))
    return out


def finite_records(meta: dict, tokens: list[int], seed: int = 0) -> list[Record]:
    """Records with finite values and accept lengths consistent with the completion length."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPE_NAMES[meta["dtype"]]
    out = []
    for i, n in enumerate(tokens):
        rows = rows_for(n, meta["mode"])
        hidden = {g["name"]: finite_rows(gen, rows, g["width"], dtype) for g in meta["layers"]}
        prompt = min(n, 2)
        decoded = n - prompt - 1
        acc = torch.ones(decoded, dtype=torch.int16) if decoded > 0 and i % 2 else None
        out.append(make_record(i, n, meta, hidden, acc, prompt_len=prompt))
    return out


def write_sink(directory: Path, meta: dict, records: list[Record], errors=(), compression: str | None = None,
               **sink_kwargs) -> Manifest:
    """The records through a ShardSink; ``compression`` replaces the metadata's codec."""
    meta = meta if compression is None else {**meta, "codec": compression}
    sink = ShardSink(directory, Manifest(meta), **sink_kwargs)
    for r in records:
        sink.add(r)
    for sid, idx, reason in errors:
        sink.add_error(sid, idx, reason)
    return sink.close()


def rewrite(src: Path, dst: Path, edit, **sink_kwargs) -> Path:
    """Copy the output ``src`` to ``dst`` through the sink, ``edit(index, sample, hidden)`` changing the cloned
    rows in place: checksums and row counts stay valid, so only a recompute can see the change."""
    import hsx

    ds = hsx.open(src)
    sink = ShardSink(dst, Manifest(ds.metadata, config_hash="rewritten"), **sink_kwargs)
    for k, s in enumerate(ds):
        hidden = {name: s.hidden(name).clone() for name in ds.columns}
        edit(k, s, hidden)
        accept = s.accept_lens
        sink.add(Record(s.sample_id, s.source_index, s.input_ids.long(), s.prompt_len, s.loss_mask, s.finish_reason,
                        hidden, None if accept is None else accept.clone(), s.verify_steps, vision=s.vision))
    sink.close()
    return dst


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])
