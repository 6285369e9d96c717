"""One Ray worker: one engine for its whole life, one work unit at a time, shards straight into the output.

Plain Python (no Ray import): the driver wraps :class:`ExtractWorker` with ``ray.remote``. A
unit is a list of ``(source index, row)`` pairs; the worker renders, batches and runs them
exactly as the single-process path does (the same functions), writes its shards under names
no other worker or attempt can produce, and returns their manifest entries. It never touches
the manifest: the driver alone commits (and renames the shards to their visible names).
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import asdict
from pathlib import Path

from hsx.config import ExtractConfig
from hsx.errors import HsxError
from hsx.pipeline import RunSummary, _pending_prompts, _run_metadata, make_renderer, run_prompts
from hsx.shards.manifest import Manifest
from hsx.shards.background import BackgroundSink


def unit_shard_name(unit: int, attempt: str, part: int) -> str:
    """``shard-<unit>-<attempt>-<part>.parquet``: the attempt is drawn afresh by every call."""
    return f"shard-{unit:06d}-{attempt}-{part:02d}.parquet"


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


class ExtractWorker:
    def __init__(self, cfg: dict, dataset_meta: dict, column_names: list[str]):
        from hsx.engine.loader import build_engine

        self.cfg = ExtractConfig.from_dict(cfg)
        self.error: str | None = None
        try:
            self.engine = build_engine(self.cfg)
            self.renderer, chat_template = make_renderer(self.cfg, self.engine, column_names)
            self.metadata = _run_metadata(self.cfg, self.engine, chat_template, dataset_meta)
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
        out = Path(cfg.output)
        manifest = Manifest(metadata=self.metadata, config_hash=cfg.fingerprint())
        sink = BackgroundSink(out, manifest, max_shard_bytes=cfg.max_shard_mb << 20,
                         max_shard_samples=cfg.max_shard_samples,
                         names=lambda part: unit_shard_name(unit, attempt, part), persist=False)
        summary = RunSummary(str(out))
        prompts = _pending_prompts(rows, self.renderer, set(done), sink, summary, _NoBar())
        try:
            run_prompts(self.engine, prompts, sink, summary, cfg, lambda n: None)
        finally:
            sink.close(complete=False)
        return {"unit": unit, "pid": os.getpid(), "host": socket.gethostname(),
                "shards": [asdict(s) for s in manifest.shards], "errors": [asdict(e) for e in manifest.errors],
                "summary": asdict(summary)}
