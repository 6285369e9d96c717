"""``hsx extract``: the run's stream (:mod:`hsx.run.core`) into shards, resumable from the manifest."""

from __future__ import annotations

import time
from pathlib import Path

from hsx.config import ExtractConfig
from hsx.run.core import Progress, RunSummary, results, write_results
from hsx.errors import ShardError
from hsx.run.output import open_manifest, prepare_output
from hsx.run.preflight import check_extract
from hsx.run.report import libraries_quiet
from hsx.run.startup import open_rows, start
from hsx.shards.background import BackgroundSink
from hsx.storage.lock import output_lock
from hsx.storage.store import as_path

__all__ = ["RunSummary", "extract"]


def extract(cfg: ExtractConfig, *, overwrite: bool = False, progress: bool = True, checked: bool = False,
            verbose: bool = False) -> RunSummary:
    """Run an extraction described by ``cfg``; resumes an interrupted run into the same output.

    The output is locked for the whole run (:class:`~hsx.storage.lock.OutputLock`, or a
    :class:`~hsx.storage.lease.Lease` in an object store).
    With ``cfg.ray`` the work is spread over Ray workers (:mod:`hsx.run.scale`). ``checked``: ``cfg`` is what
    :func:`hsx.run.preflight.check_extract` returned (the checks ran, an hsx source's fields are adopted). The libraries' own loading bars
    and info lines are hidden during the run, as the CLI hides them, unless ``verbose``.
    """
    with libraries_quiet(verbose):
        return _extract(cfg, overwrite, progress, checked)


def _extract(cfg: ExtractConfig, overwrite: bool, progress: bool, checked: bool) -> RunSummary:
    if not checked:  # the CLI runs the checks itself, before torch is imported, and hands over their config
        cfg = check_extract(cfg, overwrite)  # over an hsx output's tokens: its mode, keep and sampling adopted
    if cfg.ray:
        from hsx.run.scale import extract_ray

        return extract_ray(cfg, overwrite=overwrite, progress=progress)
    out = as_path(cfg.output)  # a local directory or a prefix in an object store
    with output_lock(out):
        return _extract_here(cfg, out, overwrite, progress)


def _extract_here(cfg: ExtractConfig, out: Path, overwrite: bool, progress: bool) -> RunSummary:
    resume = prepare_output(out, cfg, overwrite)
    t0 = time.perf_counter()
    rows, dataset_meta = open_rows(cfg)
    run = start(cfg, rows.column_names, dataset_meta)
    manifest = open_manifest(out, cfg, resume, run.metadata)

    summary = RunSummary(str(out))
    # shards are encoded and written on a thread of their own, behind a bounded queue
    sink = BackgroundSink(out, manifest, max_shard_bytes=cfg.max_shard_mb << 20,
                          max_shard_samples=cfg.max_shard_samples, lanes=cfg.writer_lanes)
    bar = Progress(len(rows), summary, progress)
    run.engine.watch_tokens(bar.tokens)
    try:
        write_results(results(run.engine, enumerate(rows), run.renderer, cfg, manifest.done_ids()), sink, summary, bar.update)
        sink.close(complete=True)
    except BaseException:  # Ctrl-C, SIGTERM or an error: everything finished so far becomes durable
        try:
            sink.close(complete=False)  # after a stop inside the close above: waits for that close to end
        except ShardError:
            pass  # the writer's own failure, raised already or behind the error being raised
        finally:
            bar.close()
        raise
    bar.close()
    summary.writer_blocked_s, summary.writer_busy_s = sink.stats.blocked_s, sink.stats.busy_s
    summary.seconds = time.perf_counter() - t0
    summary.bytes = sum(s.bytes for s in manifest.shards)
    return summary
