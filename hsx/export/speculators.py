"""Write hsx shards in the offline layout of speculators 0.9.0 (vLLM's EAGLE3 trainer).

    DST/                               the preprocessed dataset, as ``save_to_disk`` leaves it
      data-00000-of-00001.arrow        input_ids [T] int64, loss_mask [T] int64, seq_len int64
      dataset_info.json, state.json    (torch format, as speculators' preprocessing sets it)
      hidden_states/hs_0.safetensors   token_ids [T] int64, hidden_states [T, K+1, H]
      hidden_states/hs_1.safetensors   ...
      token_freq.pt                    {token id: count} over learned tokens (its vocab mapping input)
      hsx_index.jsonl                  file index -> sample id, source index, tokens
      hsx_export.json                  source, layers, alignment, counts

``speculators.train.data.ArrowDataset(max_len, DST)`` reads it: row i of the dataset and
``hs_{i}.safetensors`` are sample i; ``hidden_states[:, :-1]`` flattened is the draft's input
(K aux boundaries, ascending, as vLLM's layer loop collects them), ``hidden_states[:, -1]`` the
verifier's last state, which speculators passes through the verifier's own final norm: it is
boundary L (the last block's output before the norm), not hsx's ``final``. vLLM numbers its
``target_layer_ids`` as block inputs, so they are hsx boundaries as they stand (no +1).

Rows are as stored (row t = state after token t); speculators' ``shift_batch`` does the one shift.
Generate-mode samples export T = N-1 tokens (the last completion token has no state), prefill
ones T = N. Samples with fewer than 2 tokens left (nothing to learn after the shift) are skipped
and counted. ``hs_{i}`` files are written under temp names and renamed, without an fsync each: one
:class:`~hsx.export.files.Barrier` makes them durable before the dataset, the frequencies, the index
and the record's ``complete`` are written. A re-run keeps files that hold exactly the bytes it would
write and rewrites the rest (what a crash or a power loss left: missing, empty, short, zeroed); the
dataset, the frequencies and the index are rewritten every run (token ids only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

from hsx.errors import AlignmentError, HsxError
from hsx.export.files import (DRAFT_AT_IMAGES, INFO, Barrier, LineFile, all_finite, atomic_write, claim, clean_temps,
                              fingerprint, holds, inside, source_name, vision_note, write_json)
from hsx.export.hfdisk import DiskDatasetWriter
from hsx.export.layers import BoundarySlice, find_boundary, num_layers_of, require_every_position
from hsx.shards import ShardDataset, open_shards

FORMAT = "speculators-offline"
CHECKED_WITH = "speculators 0.9.0"
HIDDEN_DIR = "hidden_states"
INDEX = "hsx_index.jsonl"
TOKEN_FREQ = "token_freq.pt"
ROWS_PER_BLOCK = 1024  # dataset rows per Arrow record batch
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}


@dataclass
class SpeculatorsSummary:
    dst: str
    samples: int  # files exported
    skipped_short: int  # samples with < 2 tokens after the generate-mode cut
    written: int
    kept: int  # complete files left untouched
    tokens: int
    bytes_written: int
    target_layer_ids: list[int]
    num_layers: int


def hs_path(dst: Path, index: int) -> Path:
    return dst / HIDDEN_DIR / f"hs_{index}.safetensors"


def _aux_boundaries(meta: dict, given: Sequence[int] | None, num_layers: int, where: str) -> list[int]:
    if given is None:
        groups = {g["name"]: g for g in meta.get("layers", [])}
        if "eagle3" not in groups:
            raise HsxError(f"{where}: no --target-layer-ids given and no 'eagle3' column to take them from; "
                           f"give the aux boundaries (vLLM's target_layer_ids), e.g. 2,{num_layers // 2},{num_layers - 3}")
        given = groups["eagle3"]["sources"]
    ids = [int(b) for b in given]
    if len(set(ids)) != len(ids) or not ids:
        raise HsxError(f"--target-layer-ids must be distinct boundaries, got {ids}")
    bad = [b for b in ids if not 0 <= b < num_layers]
    if bad:
        raise HsxError(f"--target-layer-ids {bad} outside 0..{num_layers - 1}: boundary {num_layers} (the last block's "
                       "output) is always added as the last layer, the verifier state")
    return sorted(ids)


def _features():
    import datasets

    return datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                              "loss_mask": datasets.List(datasets.Value("int64")),
                              "seq_len": datasets.Value("int64")})


def _block(schema: pa.Schema, ids: list[torch.Tensor], masks: list[torch.Tensor]) -> pa.Table:
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = lambda xs: pa.array(torch.cat(xs).numpy() if xs else np.zeros(0, np.int64))
    return pa.Table.from_arrays([pa.ListArray.from_arrays(offsets, flat(ids)),
                                 pa.ListArray.from_arrays(offsets, flat(masks)), pa.array(lengths)], schema=schema)


def _is_complete(path: Path, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether ``path`` holds the very bytes this export writes for ``tensors`` (a power loss can leave a
    renamed file empty, short or zero-filled; any of them is rewritten)."""
    return holds(path, lambda f: write_safetensors(f, tensors))


def _states(s, slices: list[BoundarySlice], t: int) -> torch.Tensor:
    """[T, K+1, H] from the sample's columns: aux boundaries ascending, then boundary L.

    Allocated once and filled a stored piece at a time, each column read once (a long sample never has
    more than one piece of one column decoded besides the result)."""
    width = slices[0].stop - slices[0].start
    out = None
    for column in dict.fromkeys(sl.column for sl in slices):  # in the order the slices first name them
        at = 0
        for piece in s.hidden.pieces(column):
            if out is None:
                out = torch.empty((t, len(slices), width), dtype=piece.dtype)
            n = min(piece.shape[0], t - at)
            if n > 0:
                with torch._C.DisableTorchFunctionSubclass():
                    for k, sl in enumerate(slices):
                        if sl.column == column:
                            out[at:at + n, k] = piece[:n, sl.start:sl.stop]
            at += piece.shape[0]
            del piece
        if at < t:
            raise AlignmentError(f"sample {s.sample_id!r}: column {column!r} has {at} rows, "
                                 f"{t} tokens need one each")
    return out


def _plan(meta: dict, target_layer_ids: Sequence[int] | None, where: str) -> tuple[list[int], list[BoundarySlice], int]:
    """The aux boundaries (ascending), where each of them and boundary L sits, and their common width."""
    require_every_position(meta, where, "speculators")
    if meta.get("mode") not in ("generate", "prefill"):
        raise HsxError(f"{where}: unknown mode {meta.get('mode')!r}; expected generate or prefill")
    num_layers = num_layers_of(meta, where)
    aux = _aux_boundaries(meta, target_layer_ids, num_layers, where)
    slices = [find_boundary(meta, b, where) for b in [*aux, num_layers]]
    widths = {sl.stop - sl.start for sl in slices}
    if len(widths) != 1:
        raise HsxError(f"{where}: boundaries {[*aux, num_layers]} have different widths {sorted(widths)}")
    return aux, slices, widths.pop()


def _info(meta: dict, source: str, aux: list[int], width: int) -> dict:
    num_layers, mode = num_layers_of(meta, source), meta["mode"]
    return {"format": FORMAT, "writer": "hsx", "checked_with": CHECKED_WITH, "source": source,
            "source_fingerprint": fingerprint({"metadata": meta, "target_layer_ids": aux}),
            "mode": mode, "model": meta.get("model"), "stored_dtype": meta.get("dtype"), "num_layers": num_layers,
            "target_layer_ids": aux, "verifier_boundary": num_layers,
            "hidden_states": f"[T, {len(aux) + 1}, {width}]: boundaries {aux} (vLLM target_layer_ids, block "
                             f"inputs), then boundary {num_layers} (last block output, before the final norm)",
            "alignment": "row t = state after token t; " + ("generate mode: the last token (no state) dropped, T = N-1"
                                                           if mode == "generate" else "prefill mode: T = N"),
            **({"vision": vision_note(meta, DRAFT_AT_IMAGES)} if meta.get("vision") else {})}


def _write_states(path: Path, token_ids: torch.Tensor, states: torch.Tensor) -> int:
    """Bytes written to ``hs_{i}.safetensors``; 0 when the file is already there, whole. Not fsynced: the
    export's :class:`~hsx.export.files.Barrier` makes every file durable at once."""
    tensors = {"token_ids": token_ids, "hidden_states": states}
    if path.exists() and _is_complete(path, tensors):
        return 0
    return atomic_write(path, lambda f: write_safetensors(f, tensors), durable=False)


def write_safetensors(f, tensors: dict[str, torch.Tensor]) -> None:
    """The bytes ``safetensors.torch.save(tensors)`` gives, written to ``f`` straight from the tensors' memory
    (``save`` builds the whole file in memory, twice, before it can be written).

    The format: an 8-byte little-endian header length, the header (compact JSON of each tensor's dtype,
    shape and data offsets, padded with spaces to a multiple of 8), then the tensors' bytes. safetensors
    orders the tensors by dtype, widest first, then by name: here ``token_ids`` (int64) comes before the
    states (at most 4 bytes a value), and the caller passes them in that order.
    """
    import struct

    header, at = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for t in tensors.values():
        if t.numel():
            with torch._C.DisableTorchFunctionSubclass():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


class _TokenRows:
    """The dataset's rows and the learned-token counts, written in blocks as samples come."""

    def __init__(self, writer: DiskDatasetWriter):
        self.writer = writer
        self.ids: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.freq = torch.zeros(0, dtype=torch.int64)

    def add(self, token_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        learned = token_ids[loss_mask.bool()]
        if len(learned) and int(learned.max()) >= len(self.freq):
            self.freq = torch.cat([self.freq, torch.zeros(int(learned.max()) + 1 - len(self.freq), dtype=torch.int64)])
        self.freq += torch.bincount(learned, minlength=len(self.freq))
        self.ids.append(token_ids)
        self.masks.append(loss_mask)
        if len(self.ids) == ROWS_PER_BLOCK:
            self.flush()

    def flush(self) -> None:
        if self.ids:
            self.writer.write(_block(self.writer.schema, self.ids, self.masks))
            self.ids, self.masks = [], []

    def counts(self) -> dict[int, int]:
        seen = torch.nonzero(self.freq).flatten()
        return dict(zip(seen.tolist(), self.freq[seen].tolist()))  # token ids and counts: integers, not states


def export_speculators(src: str | Path | ShardDataset, dst: str | Path, *, target_layer_ids: Sequence[int] | None = None,
                       progress: bool = True) -> SpeculatorsSummary:
    """Export the shards at ``src`` to speculators' offline layout at ``dst`` (see the module docstring)."""
    from tqdm import tqdm

    # one pass in dataset order: two shards open, each keeping the row groups it is in
    ds = src if isinstance(src, ShardDataset) else open_shards(src, cache_shards=2, cache_blocks=2)
    where = str(src) if not isinstance(src, ShardDataset) else "shards"
    meta = ds.metadata
    aux, slices, width = _plan(meta, target_layer_ids, where)
    dst = Path(dst)
    info = _info(meta, where if isinstance(src, ShardDataset) else source_name(src), aux, width)
    claim(dst, info, lambda d: any(d.iterdir()))
    inside(dst, dst / HIDDEN_DIR).mkdir(exist_ok=True)
    clean_temps(dst)
    clean_temps(dst / HIDDEN_DIR)

    writer = DiskDatasetWriter(dst, _features(), fingerprint=info["source_fingerprint"][:16], format_type="torch")
    rows, index, barrier = _TokenRows(writer), LineFile(inside(dst, dst / INDEX)), Barrier(dst)
    n = written = skipped = tokens = nbytes = 0
    cut = meta["mode"] == "generate"
    try:
        for i in tqdm(range(len(ds)), desc="export speculators", unit="sample", disable=not progress):
            s = ds[i]
            ids = s.input_ids.to(torch.int64)
            t = len(ids) - cut
            if t < 2:
                skipped += 1
                continue
            token_ids, loss_mask = ids[:t].clone(), s.loss_mask[:t].to(torch.int64)
            states = _states(s, slices, t)
            if not all_finite(states):
                raise HsxError(f"sample {s.sample_id!r}: non-finite hidden states; not exported")
            size = _write_states(inside(dst, hs_path(dst, n)), token_ids, states)
            written, nbytes = written + bool(size), nbytes + size
            rows.add(token_ids, loss_mask)
            tokens += t
            index.add({"index": n, "sample_id": s.sample_id, "source_index": s.source_index, "tokens": t,
                       "shard_tokens": len(ids)})
            n += 1
        rows.flush()
        index.close()
        # the hs files (kept ones too: a killed run's may not be on disk yet) and the index lines are made
        # durable together, before the dataset that pairs its rows with them and anything that claims them
        barrier.sync()
        writer.finalize()
    except BaseException:
        writer.abort()
        index.abort()
        raise
    finally:
        barrier.close()
    counts = rows.counts()
    atomic_write(inside(dst, dst / TOKEN_FREQ), lambda f: torch.save(counts, f))
    index.commit(durable=False)  # its lines are on disk (the barrier); the rename is, once its directory is fsynced
    write_json(dst / INFO, {**info, "complete": True, "samples": n, "skipped_short": skipped, "tokens": tokens})
    return SpeculatorsSummary(str(dst), n, skipped, written, n - written, tokens, nbytes, aux, info["num_layers"])
