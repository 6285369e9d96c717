"""Write one hsx column as SAELens 6.54.12's cached activations.

    DST/data-00000-of-00002.arrow ...   rows = contexts: HOOK Array2D(C, d_in), token_ids List(int32, C)
    DST/dataset_info.json, state.json   what ``save_to_disk`` writes and ``load_from_disk`` reads
    DST/hsx_export.json                 source, boundary, hook, packing, counts

``ActivationsStore(..., cached_activations_path=DST, hook_name=HOOK, context_size=C, d_in=W)``
reads it; it checks the column's shape against (C, d_in). Hook names follow TransformerLens:
boundary b < L is ``blocks.{b}.hook_resid_pre`` (the input of block b), boundary L is
``blocks.{L-1}.hook_resid_post``, ``final`` is ``ln_final.hook_normalized``.

Packing. SAELens' own cache runner concatenates tokenized texts, with a BOS/separator token
between them, into contexts of C tokens, and drops the last partial context. hsx has no states
for tokens the samples do not hold, so it inserts no separator: with ``concat`` the samples'
rows follow each other back to back in dataset order (each row computed in its own sample's
context, not across the boundary), the last partial context is dropped and its tokens counted;
without ``concat`` each sample gives its first C rows as one context and shorter samples are
dropped (SAELens' ``disable_concat_sequences``). Row j of a context is a stored row and
``token_ids[j]`` its input token (the token at that row's position), so with ``--keep`` other
than ``all`` a context holds the kept rows back to back.

Values: bfloat16 and float16 shards become float32 exactly; ``float16`` output refuses values
outside its range. Memory: one Arrow block of contexts (~16 MB) and the rows being read: a long sample
comes a stored piece at a time (docs/FORMAT.md, "Long samples"), never whole. The files
are renamed into place and ``state.json`` is written last, so DST is never a partial dataset that
loads; a finished export with the same source and parameters is left as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from hsx.errors import HsxError
from hsx.export.files import INFO, all_finite, claim, clean_temps, fingerprint, source_name, vision_note, write_json
from hsx.export.hfdisk import STATE, DiskDatasetWriter
from hsx.export.layers import BoundarySlice, find_boundary, num_layers_of
from hsx.shards import ShardDataset, open_shards

FORMAT = "saelens-cached-activations"
CHECKED_WITH = "sae-lens 6.54.12"
BLOCK_BYTES = 16 << 20
DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class SaelensSummary:
    dst: str
    hook_name: str
    contexts: int
    context_size: int
    d_in: int
    tokens: int  # rows written (contexts x context_size)
    dropped_tokens: int  # rows of the last partial context, or of samples shorter than a context
    bytes_written: int
    skipped: bool  # an identical finished export was already there


def hook_name_for(source: int | str, num_layers: int) -> str:
    """TransformerLens' name for an hsx boundary (or ``final``)."""
    if source == "final":
        return "ln_final.hook_normalized"
    return f"blocks.{source}.hook_resid_pre" if source < num_layers else f"blocks.{num_layers - 1}.hook_resid_post"


def resolve_column(meta: dict, column: str, where: str) -> BoundarySlice:
    """``bN``/``N`` -> boundary N wherever it is stored; ``final`` -> the ``final`` column."""
    if column == "final":
        final = [g for g in meta.get("layers", []) if g["name"] == "final"]
        if not final:
            raise HsxError(f"{where}: no 'final' column; columns: {[g['name'] for g in meta.get('layers', [])]}")
        return BoundarySlice("final", "final", 0, int(final[0]["width"]))
    text = column[1:] if column.startswith("b") else column
    if not text.isdigit():
        raise HsxError(f"--column {column!r}: expected a boundary (b5 or 5) or final")
    return find_boundary(meta, int(text), where)


class _Packer:
    """Rows in, whole contexts out: ``push`` returns [k, C, W] / [k, C] blocks once enough rows wait."""

    JOIN = 256  # loose pieces joined at a time: a tensor per sample of few rows costs more than its rows

    def __init__(self, context_size: int, block_contexts: int):
        self.c, self.block = context_size, block_contexts
        self.rows: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.pending = 0
        self.loose = 0  # pieces at the end of the lists not joined yet

    def push(self, rows: torch.Tensor, tokens: torch.Tensor):
        self.rows.append(rows)
        self.tokens.append(tokens)
        self.pending += len(rows)
        if self.pending >= self.block * self.c:
            return self._take(self.pending // self.c)
        self.loose += 1
        if self.loose == self.JOIN:  # each piece is copied once here, and the lists grow by one per JOIN pieces
            for parts in (self.rows, self.tokens):
                tail = parts[-self.JOIN:]
                del parts[-self.JOIN:]
                parts.append(_drain(tail))
            self.loose = 0
        return None

    def _take(self, k: int):
        rows, tokens = _drain(self.rows), _drain(self.tokens)
        n = k * self.c
        # the rest (under one context) copied: a view would keep the whole block alive until the next one
        self.rows, self.tokens = [rows[n:].clone()], [tokens[n:].clone()]
        self.pending, self.loose = len(rows) - n, 0
        return rows[:n].view(k, self.c, -1), tokens[:n].view(k, self.c)

    def flush(self):
        """The last whole contexts; what is left (fewer than C rows) is dropped."""
        k = self.pending // self.c
        return self._take(k) if k else None


def _drain(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, emptying ``parts`` as it goes: each part is let go once copied, and the result's
    pages are touched only as they are filled, so the two are not both held whole."""
    out = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
    at = 0
    while parts:
        part = parts.pop(0)
        out[at:at + len(part)] = part
        at += len(part)
        del part
    return out


def _table(schema: pa.Schema, hook: str, acts: torch.Tensor, tokens: torch.Tensor) -> pa.Table:
    """Arrow columns over the tensors' memory: Array2D storage is list<list<value>> with fixed steps."""
    k, c, w = acts.shape
    values = pa.array(acts.contiguous().numpy().reshape(-1))
    # int32 offsets, as Array2D's storage has them: a block stays far below 2**31 values
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, k * c * w + 1, w, dtype=np.int32)), values)
    outer = pa.ListArray.from_arrays(pa.array(np.arange(0, k * c + 1, c, dtype=np.int32)), inner)
    act_col = pa.ExtensionArray.from_storage(schema.field(hook).type, outer)
    tok_col = pa.FixedSizeListArray.from_arrays(pa.array(tokens.to(torch.int32).numpy().reshape(-1)), c)
    return pa.Table.from_arrays([act_col, tok_col], schema=schema)


def _info(meta: dict, source: str, samples: int, params: dict, width: int) -> dict:
    return {"format": FORMAT, "writer": "hsx", "checked_with": CHECKED_WITH, "source": source,
            "source_fingerprint": fingerprint({"metadata": meta, "samples": samples, **params}), **params,
            "d_in": width, "keep": meta.get("keep", "all"), "mode": meta.get("mode"), "model": meta.get("model"),
            "packing": ("samples back to back in dataset order, no separator; last partial context dropped"
                        if params["concat"] else
                        "one context per sample (its first context_size rows); shorter samples dropped"),
            **({"vision": vision_note(meta, "their activations, packed with the text rows; token_ids equal "
                                            "image_token_id there, which tells them apart")} if meta.get("vision") else {})}


def _finished(dst: Path, info: dict) -> dict | None:
    """The record of a finished export of the same source and parameters at ``dst``, if there is one."""
    if (dst / INFO).is_file() and (dst / STATE).is_file():
        done = json.loads((dst / INFO).read_text())
        if done.get("complete") and done.get("source_fingerprint") == info["source_fingerprint"]:
            return done
    return None


def _pack(ds: ShardDataset, sl: BoundarySlice, writer: DiskDatasetWriter, hook: str, context_size: int,
          out_dtype: torch.dtype, concat: bool, progress: bool) -> int:
    """Every sample's rows into ``writer`` as whole contexts; returns the rows dropped."""
    from tqdm import tqdm

    packer = _Packer(context_size, max(1, BLOCK_BYTES // (context_size * (sl.stop - sl.start) * out_dtype.itemsize)))
    dropped = 0
    for i in tqdm(range(len(ds)), desc="export saelens", unit="sample", disable=not progress):
        s = ds[i]
        tokens = s.input_ids.to(torch.int64)[s.positions]  # [R]: each row's input token
        want = None  # rows to take: all of them back to back, or the first context
        if not concat:
            rows = s.num_rows
            want = context_size if rows >= context_size else 0
            dropped += rows - want
            if not want:
                continue
        at = 0
        for piece in s.hidden.pieces(sl.column):  # a long sample a stored piece at a time, never whole
            rows = piece[:, sl.start:sl.stop]  # [r, W] view
            if want is not None:
                rows = rows[:max(0, want - at)]
            n = len(rows)
            if n:
                acts = rows.to(out_dtype)
                del piece, rows  # the decoded piece goes before the contexts are cut
                if not all_finite(acts):
                    bad = "non-finite values" + (" (or values outside float16's range)" if out_dtype == torch.float16 else "")
                    raise HsxError(f"sample {s.sample_id!r}: {bad} in column {sl.column!r}; not exported")
                block = packer.push(acts, tokens[at:at + n])
                del acts
                if block is not None:
                    writer.write(_table(writer.schema, hook, *block))
                    del block
            piece = rows = None
            at += n
            if want is not None and at >= want:
                break
    block = packer.flush()
    if block is not None:
        writer.write(_table(writer.schema, hook, *block))
    return dropped + packer.pending


def export_saelens(src: str | Path | ShardDataset, dst: str | Path, *, column: str, context_size: int,
                   hook_name: str | None = None, dtype: str = "float32", concat: bool = True,
                   progress: bool = True) -> SaelensSummary:
    """Export column ``column`` of the shards at ``src`` as SAELens cached activations (module docstring)."""
    import datasets

    # one pass in dataset order: two shards open, each keeping the row groups it is in
    ds = src if isinstance(src, ShardDataset) else open_shards(src, cache_shards=2, cache_blocks=2)
    where = str(src) if not isinstance(src, ShardDataset) else "shards"
    meta = ds.metadata
    if context_size < 1:
        raise HsxError(f"--context-size must be >= 1, got {context_size}")
    if dtype not in DTYPES:
        raise HsxError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    sl = resolve_column(meta, column, where)
    width = sl.stop - sl.start
    hook = hook_name or hook_name_for(sl.boundary, num_layers_of(meta, where))
    params = {"column": sl.column, "boundary": sl.boundary, "hook_name": hook, "context_size": context_size,
              "dtype": dtype, "concat": concat}
    dst = Path(dst)
    info = _info(meta, where if isinstance(src, ShardDataset) else source_name(src), len(ds), params, width)
    done = _finished(dst, info)
    if done is not None:
        return SaelensSummary(str(dst), hook, done["contexts"], context_size, width, done["tokens"],
                              done["dropped_tokens"], 0, True)
    claim(dst, info, lambda d: any(d.iterdir()))
    clean_temps(dst)

    features = datasets.Features({hook: datasets.Array2D((context_size, width), dtype),
                                  "token_ids": datasets.List(datasets.Value("int32"), length=context_size)})
    writer = DiskDatasetWriter(dst, features, fingerprint=info["source_fingerprint"][:16])
    try:
        dropped = _pack(ds, sl, writer, hook, context_size, DTYPES[dtype], concat, progress)
        contexts = writer.finalize()
    except BaseException:
        writer.abort()
        raise
    write_json(dst / INFO, {**info, "complete": True, "contexts": contexts, "tokens": contexts * context_size,
                            "dropped_tokens": dropped})
    return SaelensSummary(str(dst), hook, contexts, context_size, width, contexts * context_size, dropped,
                          writer.bytes, False)
