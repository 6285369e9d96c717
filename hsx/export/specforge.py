"""Write hsx shards in SpecForge's offline EAGLE3 layout.

    DST/
      rows_0-2000/data_0.ckpt ... data_1999.ckpt     one torch.save dict per sample
      rows_2000-4000/data_2000.ckpt ...
      vocab_mapping/vocab_mapping.pt                 {"d2t": int64 [D], "t2d": bool [V]}
      hsx_index.jsonl                                file -> shard sample id, one line per file
      hsx_export.json                                source, layers, alignment, vocab sizes

Each ``data_{i}.ckpt`` holds ``input_ids`` [T] int64, ``loss_mask`` [T] int64,
``hidden_state`` [1, T, H] bfloat16 (final-norm output) and ``aux_hidden_state`` [1, T, 3H]
bfloat16, exactly as SpecForge's ``prepare_hidden_states.py`` writes them and its
``OfflineManifestReader`` / ``normalize_offline_sample`` read them; the tensors are those of
:class:`hsx.eagle3.Eagle3Dataset` (alignment and the generate-mode rule are documented there).
Sample i is the i-th sample of the shards in manifest order.

Files are written under a hidden temp name and renamed, so a file with a final name is whole to
every reader; they are not fsynced one by one: one :class:`~hsx.export.files.Barrier` makes them
durable before the index, the vocabulary mapping and the record's ``complete`` are written. A re-run
keeps files that hold exactly the bytes it would write and rewrites anything else (what a crash or
a power loss left: missing, empty, short, zeroed); leftover temp files are removed. Paths are built from
indices only, so sample ids never reach the file system. A destination exported from different
shards (other metadata) is refused rather than mixed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from hsx.eagle3.dataset import Eagle3Dataset, check_eagle3_layout, load_draft_config
from hsx.eagle3.vocab import count_loss_tokens, vocab_mapping
from hsx.errors import HsxError
from hsx.export.files import (DRAFT_AT_IMAGES, INFO, Barrier, LineFile, all_finite, atomic_write, claim, clean_temps,
                              fingerprint, holds, inside, own, source_name, vision_note, write_json)
from hsx.shards.reader import open_shards

GROUP = 2000  # files per rows_* directory, SpecForge's default --file-group-size
INDEX = "hsx_index.jsonl"
VOCAB = Path("vocab_mapping") / "vocab_mapping.pt"
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


@dataclass
class ExportSummary:
    dst: str
    samples: int
    written: int  # new files and replaced ones
    skipped: int  # complete files left untouched
    replaced: int  # files present but incomplete or different, rewritten
    tokens: int
    bytes_written: int
    draft_vocab_size: int
    target_vocab_size: int
    vocab_coverage: float  # share of learned-token occurrences inside the draft vocabulary


def relative_path(index: int) -> Path:
    g = index // GROUP * GROUP
    return Path(f"rows_{g}-{g + GROUP}") / f"data_{index}.ckpt"


def _is_complete(path: Path, record: dict) -> bool:
    """Whether ``path`` holds the very bytes ``torch.save(record)`` writes (a power loss can leave a renamed
    file empty, short or zero-filled; any of them, or another sample's file, is rewritten)."""
    return holds(path, lambda f: torch.save(record, f))


def _target_vocab_size(metadata: dict, draft: dict | None, given: int | None) -> tuple[int, str]:
    if given is not None:
        return int(given), "given"
    if draft and draft.get("vocab_size"):
        return int(draft["vocab_size"]), "draft config vocab_size"
    path = (metadata.get("model") or {}).get("path")
    if path and (Path(path) / "config.json").is_file():
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg = cfg.get("text_config") or cfg
        if cfg.get("vocab_size"):
            return int(cfg["vocab_size"]), f"{path}/config.json vocab_size"
    raise HsxError(
        f"cannot tell the target vocabulary size: the shards' model path {path!r} has no readable config.json; "
        "pass a draft config with vocab_size (or target_vocab_size)"
    )


def export_specforge(src: str | Path, dst: str | Path, *, draft_vocab_size: int | None = None,
                     draft_config: str | Path | Mapping | None = None, target_vocab_size: int | None = None,
                     progress: bool = True) -> ExportSummary:
    """Export the shards at ``src`` to SpecForge's offline layout at ``dst`` (see the module docstring).

    ``draft_config`` (a dict, config.json or its directory) is checked against the shards' widths
    and eagle3 boundaries and supplies ``draft_vocab_size`` and the target ``vocab_size`` when
    they are not given; without it the target vocabulary size comes from the model's config.json
    at the shards' ``model.path``, and the draft vocabulary defaults to the whole target vocabulary.
    """
    from tqdm import tqdm

    draft = load_draft_config(draft_config)
    # one pass in dataset order: as many shards open as hsx.open keeps (a run's lanes interleave there), each
    # keeping the row groups it is in
    shards = open_shards(src, cache_blocks=2)
    check_eagle3_layout(shards.metadata, draft, str(src))  # refused naming src, as Eagle3Dataset(src) would
    ds = Eagle3Dataset(shards, draft)
    meta = ds.shards.metadata
    vocab_size, vocab_from = _target_vocab_size(meta, draft, target_vocab_size)
    if draft_vocab_size is None:
        draft_vocab_size = int(draft.get("draft_vocab_size") or vocab_size) if draft else vocab_size
    if not 1 <= draft_vocab_size <= vocab_size:
        raise HsxError(f"--draft-vocab-size must be in 1..{vocab_size} (target vocabulary, {vocab_from}), got {draft_vocab_size}")

    dst = Path(dst)
    info = {
        "format": "specforge-offline-eagle3", "writer": "hsx", "complete": False, "source": source_name(src),
        "source_fingerprint": fingerprint(meta), "config_hash": meta.get("config_hash"), "mode": ds.layout.mode,
        "model": meta.get("model"), "stored_dtype": ds.layout.stored_dtype,
        "aux_boundaries": list(ds.layout.aux_boundaries), "hidden_size": ds.layout.hidden_size,
        "alignment": "row t = state after consuming token t (aux_hidden_state and hidden_state); "
                     + ("generate mode: the last token (no state) is dropped, T = N-1" if ds.layout.mode == "generate"
                        else "prefill mode: T = N"),
        "draft_vocab_size": draft_vocab_size, "target_vocab_size": vocab_size, "target_vocab_size_from": vocab_from,
        "files_per_directory": GROUP,
    }
    note = vision_note(meta, DRAFT_AT_IMAGES)
    if note:
        info["vision"] = note
    claim(dst, info, lambda d: any(p.name.startswith("rows_") for p in d.iterdir()))
    for d in [dst, dst / VOCAB.parent, *dst.glob("rows_*")]:
        clean_temps(d)

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    written, skipped, replaced, tokens, nbytes = 0, 0, 0, 0, 0
    index, barrier, made = LineFile(inside(dst, dst / INDEX)), Barrier(dst), None
    try:
        for i in tqdm(range(len(ds)), desc="export specforge", unit="sample", disable=not progress):
            shard_sample = ds.shards[i]
            sample = ds[i]
            # vocabulary counts over every stored token, the generate-mode last one included
            counts += count_loss_tokens([(shard_sample.input_ids, shard_sample.loss_mask)], vocab_size)
            for key in ("aux_hidden_state", "hidden_state"):
                if not all_finite(sample[key]):
                    raise HsxError(f"sample {sample['sample_id']!r}: non-finite values in {key}; not exported")
            # memory of their own: torch.save writes whole storages, and a sample stored whole is a view into its
            # row group's block (a copy); a long sample's states are decoded into tensors of their own (no copy)
            record = {
                "input_ids": sample["input_ids"].clone(),
                "loss_mask": sample["loss_mask"].clone(),
                "hidden_state": own(sample["hidden_state"]).unsqueeze(0),  # [1, T, H]
                "aux_hidden_state": own(sample["aux_hidden_state"]).unsqueeze(0),  # [1, T, 3H]
            }
            sample_id = sample["sample_id"]
            del sample
            rel = relative_path(i)
            path = dst / rel
            if path.parent != made:  # a group directory, made once
                inside(dst, path.parent).mkdir(exist_ok=True)
                made = path.parent
            inside(dst, path)
            exists = path.exists()
            if exists and _is_complete(path, record):
                skipped += 1
            else:
                replaced += exists
                # no fsync: the barrier below makes every file durable at once
                nbytes += atomic_write(path, lambda f: torch.save(record, f), durable=False)
                written += 1
            t = len(record["input_ids"])
            tokens += t
            index.add({"index": i, "file": rel.as_posix(), "sample_id": sample_id,
                       "source_index": shard_sample.source_index, "tokens": t,
                       "shard_tokens": len(shard_sample.input_ids)})
        index.close()
        # the files (kept ones too: a killed run's may not be on disk yet), their group directories and the
        # index lines, made durable together before the index and the record claim them
        barrier.sync()
    except BaseException:
        index.abort()
        raise
    finally:
        barrier.close()

    d2t, t2d = vocab_mapping(counts, draft_vocab_size)
    inside(dst, dst / VOCAB.parent).mkdir(exist_ok=True)
    vocab_path = inside(dst, dst / VOCAB)
    old = None
    if vocab_path.exists():
        try:
            old = torch.load(vocab_path, map_location="cpu", weights_only=True)
        except Exception:
            old = None
    if not (isinstance(old, dict) and set(old) == {"d2t", "t2d"} and torch.equal(old["d2t"], d2t) and torch.equal(old["t2d"], t2d)):
        atomic_write(vocab_path, lambda f: torch.save({"d2t": d2t, "t2d": t2d}, f))
    index.commit(durable=False)  # its lines are on disk (the barrier); the rename is, once its directory is fsynced
    total = int(counts.sum())
    coverage = float(counts[t2d].sum()) / total if total else 0.0
    info.update(complete=True, samples=len(ds), tokens=tokens, vocab_coverage=coverage)
    write_json(dst / INFO, info)
    return ExportSummary(str(dst), len(ds), written, skipped, replaced, tokens, nbytes, draft_vocab_size, vocab_size, coverage)
