"""One Ray worker: one engine for its whole life, one work unit at a time, shards straight into the output.

Plain Python (no Ray import): the driver wraps :class:`ExtractWorker` with ``ray.remote``. A
unit is a list of ``(source index, row)`` pairs; the worker renders, batches and runs them
exactly as the single-process path does (:func:`hsx.run.core.results`), writes its shards under names
no other worker or attempt can produce, and returns their manifest entries. It never touches
the manifest: the driver alone commits (and renames the shards to their visible names). For the online feed (:meth:`ExtractWorker.stream_unit`,
:meth:`ExtractWorker.stream_unit_split`) it hands the unit's records back instead (:func:`encode_item`)
and writes nothing.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import asdict

import numpy as np
import torch

from hsx.config import ExtractConfig
from hsx.run.core import Failure, Resumed, RunSummary, results, write_results
from hsx.run.startup import start
from hsx.errors import HsxError
from hsx.shards.background import BackgroundSink
from hsx.shards.manifest import Manifest
from hsx.shards.sink import fan_out
from hsx.storage.store import as_path
from hsx.shards.writer import Record


def encode_item(item: Record | Failure) -> dict:
    """A record or failure as plain values and numpy arrays, for the trip back to the driver
    (bfloat16 rows travel as their int16 bit patterns: numpy has no bfloat16)."""
    if isinstance(item, Failure):
        return {"failure": asdict(item)}
    if item.vision is not None:
        raise HsxError(f"sample {item.sample_id!r}: the image columns of a vision-language target do not travel "
                       "between Ray workers; run it without --ray")
    item.wait()
    hidden = {name: (h.contiguous().view(torch.int16) if h.dtype == torch.bfloat16 else h.contiguous()).numpy()
              for name, h in item.hidden.items()}
    return {"sample_id": item.sample_id, "source_index": item.source_index, "input_ids": item.input_ids.numpy(),
            "prompt_len": item.prompt_len, "loss_mask": item.loss_mask.numpy(), "finish_reason": item.finish_reason,
            "hidden": hidden, "bfloat16": [name for name, h in item.hidden.items() if h.dtype == torch.bfloat16],
            "accept_lens": None if item.accept_lens is None else item.accept_lens.numpy(),
            "verify_steps": item.verify_steps}


def decode_item(d: dict) -> Record | Failure:
    """The inverse of :func:`encode_item`; tensors own their memory (copies of the arrays received)."""
    if "failure" in d:
        return Failure(**d["failure"])

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a))

    hidden = {name: tensor(a).view(torch.bfloat16) if name in d["bfloat16"] else tensor(a) for name, a in d["hidden"].items()}
    return Record(d["sample_id"], d["source_index"], tensor(d["input_ids"]), d["prompt_len"], tensor(d["loss_mask"]),
                  d["finish_reason"], hidden, None if d["accept_lens"] is None else tensor(d["accept_lens"]), d["verify_steps"])


def unit_shard_name(unit: int, attempt: str, part: int) -> str:
    """``shard-<unit>-<attempt>-<part>.parquet`` (fanned out by unit, see :func:`hsx.shards.sink.fan_out`):
    the attempt is drawn afresh by every call."""
    return fan_out(f"shard-{unit:06d}-{attempt}-{part:02d}.parquet", unit)


class ExtractWorker:
    def __init__(self, cfg: dict, dataset_meta: dict, column_names: list[str]):
        self.cfg = ExtractConfig.from_dict(cfg)
        self.error: str | None = None
        try:
            run = start(self.cfg, column_names, dataset_meta)
            self.engine, self.renderer, self.metadata = run.engine, run.renderer, run.metadata
        except HsxError as e:  # reported by describe(), so the driver can show the message as it is
            self.error = str(e)

    def describe(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "error": self.error,
                "metadata": None if self.error else self.metadata}

    def run_unit(self, unit: int, rows: list, done: list[str]) -> dict:
        """Run one unit; returns its shard entries, error records and counts for the driver to commit."""
        if self.error:
            raise HsxError(self.error)
        cfg = self.cfg
        attempt = uuid.uuid4().hex[:12]
        out = as_path(cfg.output)  # in an object store the sink uploads the shards under their staging names
        manifest = Manifest(metadata=self.metadata, config_hash=cfg.fingerprint())
        sink = BackgroundSink(out, manifest, max_shard_bytes=cfg.max_shard_mb << 20,
                         max_shard_samples=cfg.max_shard_samples, lanes=cfg.writer_lanes,
                         names=lambda part: unit_shard_name(unit, attempt, part), persist=False)
        summary = RunSummary(str(out))
        try:
            write_results(results(self.engine, rows, self.renderer, cfg, set(done)), sink, summary)
        finally:
            sink.close(complete=False)
        return {"unit": unit, "pid": os.getpid(), "host": socket.gethostname(),
                "shards": [s.to_json() for s in manifest.shards], "errors": [asdict(e) for e in manifest.errors],
                "summary": asdict(summary)}

    def stream_unit(self, rows: list) -> list[dict]:
        """Run one unit for the online feed: its records and failures (:func:`encode_item`), no shards."""
        if self.error:
            raise HsxError(self.error)
        return [encode_item(item) for item in results(self.engine, rows, self.renderer, self.cfg)
                if not isinstance(item, Resumed)]

    def stream_unit_split(self, rows: list) -> tuple:
        """Run one unit for a feed shared by ranks (:mod:`hsx.run.scale.ranks`): ``(index, *items)``, the
        unit's items as :meth:`stream_unit` gives them, each a return value of its own (called with
        ``num_returns=len(rows) + 1``, so each travels as its own object to the one rank that takes
        it), and ``index``, the ``(source_index, is_failure)`` of each, for the pool to share them out
        without reading them."""
        items = self.stream_unit(rows)
        if len(items) != len(rows):
            raise HsxError(f"a unit of {len(rows)} rows gave {len(items)} records and failures; every row gives one")
        index = [(d["failure"]["source_index"], True) if "failure" in d else (d["source_index"], False) for d in items]
        return (index, *items)
