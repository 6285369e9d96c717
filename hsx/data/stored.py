"""An hsx output as a dataset: its stored samples, to run again teacher-forced with other layers.

``hsx extract --dataset OUT`` with OUT an hsx output directory (recognised by its manifest) reads
no text: each row is one of OUT's samples, its tokens as OUT stores them, or one of OUT's error
records. The renderer (:func:`hsx.data.render.stored_prompt`) turns a row into a prompt that
carries the sample's tokens, ``prompt_len``, loss mask, finish reason and accept lengths, and the
engine (:mod:`hsx.engine.replay.runner`) feeds the tokens teacher-forced and checks every column the two
outputs share against OUT's rows.

The new output has OUT's samples at OUT's positions, so the run takes OUT's ``mode``, ``keep``
and sampling fields (:func:`adopt_source`); options about turning text into tokens or decoding
do not apply and are refused. Nothing here imports torch: the CLI's checks call
:func:`adopt_source` before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import xxhash

from hsx.config import ExtractConfig
from hsx.errors import HsxError
from hsx.shards.manifest import LEGACY_MANIFEST, MANIFEST, MANIFEST_FORMAT, Manifest, load_manifest

# the base columns a row carries from the source output, and the reason of a source error record
COLUMNS = ("sample_id", "source_index", "input_ids", "prompt_len", "loss_mask", "finish_reason", "verify_steps",
           "accept_lens")
SOURCE_ERROR = "source_error"
# what turns text into tokens or decodes: a run over stored tokens has none of it
NOT_APPLICABLE = ("draft_model", "spec_num_steps", "spec_topk", "spec_num_draft_tokens", "spec_algorithm",
                  "chat_template", "text_field", "id_field", "max_length", "split")
SAMPLING = ("max_new_tokens", "temperature", "top_p", "seed")  # recorded in generate-mode metadata


def is_hsx_output(source: str) -> bool:
    """Whether ``source`` is an hsx output directory: it holds ``.hsx-manifest.json``, or (before
    format 4) a ``manifest.json`` whose ``format`` says it is an hsx manifest."""
    path = Path(source).expanduser()
    if (path / MANIFEST).is_file():
        return True
    legacy = path / LEGACY_MANIFEST
    if not legacy.is_file():
        return False
    try:
        return json.loads(legacy.read_text()).get("format") == MANIFEST_FORMAT
    except (OSError, ValueError):
        return False


def source_manifest(source: str) -> Manifest:
    """The manifest of the source output, refused while its run has not finished."""
    m = load_manifest(source)
    if not m.complete:
        raise HsxError(f"--dataset {source}: this hsx output's run has not finished (its manifest is not marked "
                       "complete); finish it by running its command again, then run over its tokens")
    return m


def adopt_source(cfg: ExtractConfig, source_meta: dict | None = None) -> ExtractConfig:
    """``cfg`` for a run over the hsx output ``cfg.dataset``: its ``mode``, ``keep`` and sampling fields
    (and ``model``, when none is given) are the source's. A field left at its default takes the
    source's value; any other value must equal it. Any other dataset: ``cfg`` as it is.
    ``source_meta``: the source's metadata when the caller has read it already."""
    if not is_hsx_output(cfg.dataset):
        return cfg
    if cfg.output and Path(cfg.output).expanduser().resolve() == Path(cfg.dataset).expanduser().resolve():
        raise HsxError(f"--output {cfg.output} is the hsx output read as --dataset: write the new output elsewhere")
    meta = source_manifest(cfg.dataset).metadata if source_meta is None else source_meta
    default = ExtractConfig()
    given = [f"--{name.replace('_', '-')} {getattr(cfg, name)!r}" for name in NOT_APPLICABLE
             if getattr(cfg, name) != getattr(default, name)]
    if given:
        verb, them = ("does", "it") if len(given) == 1 else ("do", "them")
        raise HsxError(f"--dataset {cfg.dataset} is an hsx output: its samples are tokenized and decoded already, "
                       f"so {', '.join(given)} {verb} not apply; leave {them} out")
    sampling = meta.get("sampling") or {}
    wanted = {"mode": meta["mode"], "keep": meta.get("keep", "all")}
    wanted.update((k, sampling[k]) for k in SAMPLING if k in sampling)
    if not cfg.model:
        wanted["model"] = (meta.get("model") or {}).get("path") or ""
    changes = {}
    for name, value in wanted.items():
        have = getattr(cfg, name)
        if have == value:
            continue
        if have != getattr(default, name):
            raise HsxError(f"--{name.replace('_', '-')} {have!r}: the hsx output {cfg.dataset} was made with "
                           f"{name} {value!r}, and a run over its tokens keeps it (leave the option out)")
        changes[name] = value
    return dataclasses.replace(cfg, **changes)


def load_stored_rows(source: str):
    """A ``datasets.Dataset`` of the source output's rows in source order: one per source row, a sample
    (:data:`COLUMNS`) or an error record (``source_error`` holds its reason). Every shard is
    checked against the manifest as it is read. The source indices must be ``0..n-1``."""
    import datasets
    import numpy as np
    import pyarrow as pa

    from hsx.shards.reader import open_shards

    m = source_manifest(source)
    samples = open_shards(source).table(list(COLUMNS))
    samples = samples.append_column(SOURCE_ERROR, pa.nulls(samples.num_rows, pa.string()))
    errors = pa.Table.from_pylist([{"sample_id": e.sample_id, "source_index": e.source_index, SOURCE_ERROR: e.reason}
                                   for e in m.errors], schema=samples.schema)
    table = pa.concat_tables([samples, errors]).sort_by("source_index")
    indices = table.column("source_index").to_numpy()  # [n] int64, one array, not n Python ints
    if not len(indices):
        raise HsxError(f"--dataset {source}: the hsx output holds no samples and no error records")
    gaps = np.flatnonzero(indices != np.arange(len(indices)))
    if len(gaps):
        missing = int(gaps[0])
        raise HsxError(f"--dataset {source}: no sample or error record for source row {missing} (the next one is "
                       f"row {indices[missing]}); a run over an output's tokens needs every row from 0 on")
    return datasets.Dataset(table)


def manifest_fingerprint(m: Manifest) -> str:
    """Identity of an output's content: xxh3-64 over its shards' names and checksums, its error records
    and its config hash (a shard's checksum covers its every byte)."""
    content = {"config_hash": m.config_hash, "shards": [[s.file, s.xxh3_128] for s in m.shards],
               "errors": [[e.sample_id, e.source_index, e.reason] for e in m.errors]}
    return xxhash.xxh3_64(json.dumps(content, sort_keys=True).encode()).hexdigest()


def describe_stored(source: str, split: str, num_rows: int) -> dict:
    """What the new output's metadata says about its dataset: the source output, and where its tokens came from."""
    m = source_manifest(source)
    meta, fingerprint = m.metadata, manifest_fingerprint(m)
    return {
        "source": source, "split": split, "num_rows": num_rows, "fingerprint": fingerprint,
        "tokens_from": {
            "output": source,
            "config_hash": m.config_hash,
            "manifest_fingerprint": fingerprint,
            "model_config_sha256": (meta.get("model") or {}).get("config_sha256"),
            "mode": meta["mode"],
            "keep": meta.get("keep", "all"),
            "engine": meta.get("engine"),
            "dataset": meta.get("dataset"),
        },
    }
