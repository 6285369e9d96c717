"""Plain-text renderings of inspect summaries, verify reports and run summaries for the CLI."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from hsx.storage.store import is_remote

# The libraries' own bars and info lines (weights loading, dataset conversion, Ray's start-up),
# silenced unless the user set these variables or asked for -v: hsx prints one bar and one summary.
LIBRARY_QUIET = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "RAY_LOGGER_LEVEL": "error",
    "RAY_DEDUP_LOGS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's info lines and warnings (and the weights' loading bar: the vllm runner)
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # torch's C++ warnings (vLLM's CPU worker: "NUMA binding ...")
}


@contextmanager
def libraries_quiet(verbose: bool = False):
    """:func:`quiet_libraries` for the length of a ``with`` block, then the environment and the
    libraries' switches as they were: the Python API's runs print what the CLI's do (its own bar),
    and a notebook's other cells keep their bars."""
    if verbose:
        yield
        return
    import datasets
    from transformers.utils import logging as hf_logging

    env = {k: os.environ.get(k) for k in LIBRARY_QUIET}
    saved = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity(),
             not datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity(),
             logging.getLogger("vllm").level)
    try:
        with warnings.catch_warnings():
            quiet_libraries()
            yield
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved[0]:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(saved[1])
        if saved[2]:
            datasets.enable_progress_bars()
        datasets.logging.set_verbosity(saved[3])
        logging.getLogger("vllm").setLevel(saved[4])


def quiet_libraries(verbose: bool = False) -> None:
    """Set :data:`LIBRARY_QUIET` in the environment where it is unset (the libraries read it when
    they are imported; Ray's workers inherit it), and tell the libraries this process has already
    imported the same through their own switches; ``verbose`` leaves everything as it is."""
    if verbose:
        return
    for key, value in LIBRARY_QUIET.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations inside the libraries, not the user's to fix
    # vLLM logs a few lines while it is imported, before it applies VLLM_LOGGING_LEVEL to its loggers
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


def size_text(n: float) -> str:
    """Bytes in the unit that keeps 2-3 significant digits: ``940 B``, ``288 KB``, ``3.1 MB``, ``1.24 GB``
    (decimal units, as disks and ``ls -h --si`` count)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:,.{2 if value < 10 and unit in ('GB', 'TB') else 1 if value < 100 else 0}f} {unit}"
    return f"{n:,.0f} B"


ERRORS_SHOWN = 10  # error records format_inspect lists unless asked for all


def format_inspect(s: dict, all_errors: bool = False) -> str:
    lines = [
        f"{s['path']}",
        f"  samples       {s['samples']:,} in {s['shards']} shard(s)"
        + (f", {s['errors']} error record(s)" if s["errors"] else "")
        + ("" if s["complete"] in (None, True) else "  [incomplete run: resume to finish]"),
        f"  tokens        {s['tokens']:,} ({s['prompt_tokens']:,} prompt + {s['completion_tokens']:,} completion)",
        f"  rows/column   {s['rows_per_column']:,}   mode {s['mode']}" + _keep_note(s),
        f"  size          {size_text(s['bytes'])}, {s['bytes_per_token']:,.0f} bytes/token",
        f"  dtype         {s['dtype']}",
        "  layers",
    ]
    for g in s["layers"]:
        lines.append(f"    {g['name']:<10} width {g['width']:<6} sources {g['sources']}  ({g['rule']})")
    model = s.get("model") or {}
    if model:
        lines.append(f"  model         {model.get('path', '?')}  ({model.get('num_layers', '?')} blocks, hidden {model.get('hidden_size', '?')})")
    engine = s.get("engine") or {}
    if engine:
        lines.append(f"  engine        {engine.get('name', '?')} {engine.get('version', '')}".rstrip())
    spec = s.get("speculative")
    if spec:
        lines.append(f"  speculative   {spec}")
    if s.get("finish_reasons"):
        lines.append(f"  finish        {s['finish_reasons']}")
    acc = s.get("accept")
    if acc:
        hist = ", ".join(f"{k}:{v}" for k, v in acc["histogram"].items())
        lines.append(f"  accept        mean {acc['mean_accept_len']:.2f} tokens/step over {acc['verify_steps']:,} verify steps  [{hist}]")
    lines += _error_lines(s.get("error_records") or [], all_errors)
    return "\n".join(lines)


def _keep_note(s: dict) -> str:
    if s.get("keep", "all") == "all":
        return ""
    saved = s["bytes_saved"]
    return (f"   keep {s['keep']} ({s['rows_per_column']:,} of {s['rows_covered']:,} rows; "
            f"{size_text(saved)} of hidden states not stored)")


def _error_lines(records: list[dict], all_errors: bool) -> list[str]:
    if not records:
        return []
    shown = records if all_errors else records[:ERRORS_SHOWN]
    lines = [f"  errors        {len(records)} sample(s) not extracted:"]
    for e in shown:
        lines.append(f"    {e['sample_id']}  (source row {e['source_index']}): {e['reason']}")
    if len(shown) < len(records):
        lines.append(f"    ... and {len(records) - len(shown)} more (hsx inspect --errors lists them all)")
    return lines


def format_verify(r) -> str:
    lines = [f"{r.path}"]
    for f in r.faults:
        lines.append(f"  FAULT  {f}")
    for s in r.shards:
        status = "ok   " if not s.faults else "FAULT"
        lines.append(f"  {status}  {s.file}: {s.samples} samples, {s.rows} rows")
        for f in s.faults:
            lines.append(f"           - {f}")
    for name in r.ignored:
        lines.append(f"  ignored  {name} ({_why_ignored(name, name in r.foreign)})")
    for name in sorted(set(r.foreign) - set(r.ignored)):
        lines.append(f"  ignored  {name}/ ({_why_ignored(name, True)})")
    if r.errors:
        lines.append(f"  note   {r.errors} sample(s) recorded as input errors (see the manifest's 'errors')")
    if r.complete is False:
        lines.append(f"  note   the run is incomplete (in progress, or stopped): {r.samples:,} samples committed; "
                     "re-run the same hsx extract command to resume")
    bad = sum(1 for s in r.shards if s.faults) + (1 if r.faults else 0)
    lines.append("verify: OK" if r.ok else f"verify: FAILED ({bad} shard(s) or manifest with faults)")
    return "\n".join(lines)


def _why_ignored(name: str, foreign: bool) -> str:
    """Why a file the manifest does not name is there, and who reads it: hsx readers skip it; pandas,
    pyarrow and datasets skip hidden names only."""
    if name.startswith("."):
        return "hidden, not in the manifest: a leftover of an interrupted write or another tool's; every reader skips it"
    if foreign:
        return ("not written by hsx: hsx.open skips it, but pandas, pyarrow and datasets read every visible file of the "
                "directory and fail on it or read it as rows; move it out")
    return ("a shard the manifest does not commit: hsx.open skips it, but pandas, pyarrow and datasets would read its "
            "rows as well; move it out")


def format_interrupted(output: str, by: str | None = None) -> str:
    """What a Ctrl-C (or the signal ``by`` names) left behind: the samples the output's manifest
    commits, and how to go on."""
    from hsx.errors import ShardError
    from hsx.shards.manifest import load_manifest, manifest_path

    try:
        m = load_manifest(output) if manifest_path(Path(output)).is_file() else None
    except ShardError:
        m = None
    stopped = f"interrupted by {by}" if by else "interrupted"
    if m is None:
        return f"{stopped}: nothing committed to {output} yet; re-run the same command to start"
    errors = f" and {len(m.errors):,} error record(s)" if m.errors else ""
    return (f"{stopped}: {m.num_samples:,} samples{errors} committed to {output}; "
            "re-run the same command to resume")


def format_run(s) -> str:
    rate = s.tokens / s.seconds if s.seconds else 0.0
    lines = [
        f"wrote {s.samples:,} samples ({s.tokens:,} tokens, {s.completion_tokens:,} generated, {s.rows:,} rows per column) "
        f"to {s.output} in {s.seconds:.1f} s, start-up included ({rate:,.0f} tokens/s)",
        f"  shards {'in the object store' if is_remote(s.output) else 'on disk'}: {size_text(s.bytes)} in total",
    ]
    if not s.workers:  # under --ray each worker has its own writer
        lines.append(f"  shard writer: the engine waited {s.writer_blocked_s:.2f} s on it (its threads busy {s.writer_busy_s:.1f} s)")
    else:
        lines.append(f"  ray: {s.workers} workers" + (f"; {s.retried} unit(s) retried on another worker after "
                                                      "theirs was lost" if s.retried else ""))
    if s.resumed:
        lines.append(f"  resumed: {s.resumed:,} samples were already done and were skipped")
    if s.errors:
        lines.append(f"  input errors: {s.errors:,} samples recorded in the manifest's 'errors' (see hsx inspect)")
    if s.no_rows:
        lines.append(f"  no rows: {s.no_rows:,} samples stored with no hidden rows: --keep kept none of their positions "
                     "(under --keep loss, a chat with no assistant turn; see docs/OPTIONS.md)")
    if s.mean_accept_len is not None:
        lines.append(f"  speculative: mean accept length {s.mean_accept_len:.2f} over {s.verify_steps:,} verify steps")
    return "\n".join(lines)


def _source(s) -> str:
    return str(s)


def format_recompute(r, list_limit: int = 50) -> str:
    """The recompute's verdicts: per column source, per sample (all of them up to ``list_limit``), findings, timing."""
    t = r.tolerance
    lines = [
        f"recompute: {r.model} on {r.device} in {r.compute_dtype} (rows stored as {r.stored_dtype}, computed in "
        f"{r.engine_compute_dtype or 'an unrecorded dtype'}); a row passes with relative error <= {t['rel']:.3g} "
        f"and cosine >= {t['cos']:.6f}, and no neighbouring position, sample or layer closer",
        f"  {'column':<10} {'source':<7} {'rows':>9} {'worst rel':>10} {'mean rel':>10} {'worst cos':>10} {'bad':>7}",
    ]
    for s in r.sources:
        lines.append(f"  {s.column:<10} {_source(s.source):<7} {s.rows:>9,} {s.worst_rel:>10.3g} {s.mean_rel:>10.3g} "
                     f"{s.worst_cos:>10.6f} {s.bad_rows:>7,}")
    for s in r.sources:
        if s.matches is not None:
            lines.append(f"  FAULT  column {s.column!r} source {s.source} matches {s.matches} better than its own "
                         f"(mean relative error {s.layer_mean[s.matches]:.3g} against it, {s.mean_rel:.3g} against "
                         f"its own, over {s.rows:,} rows)")
        if s.bad_rows:
            what = ", ".join(f"{k}: {v:,}" for k, v in sorted(s.matched.items(), key=lambda kv: -kv[1]))
            lines.append(f"  FAULT  column {s.column!r} source {s.source}: {s.bad_rows:,} of {s.rows:,} rows faulty ({what})")
    shown = r.samples if len(r.samples) <= list_limit else [x for x in r.samples if x.findings][:list_limit]
    lines.append(f"  {'sample':<24} {'rows':>7} {'worst rel':>10} {'worst cos':>10}  verdict")
    for x in shown:
        lines.append(f"  {x.sample_id:<24} {x.rows:>7,} {x.worst_rel:>10.3g} {x.worst_cos:>10.6f}  {x.verdict}")
        for f in x.findings[:10]:
            lines.append(f"           - {f.message}")
        if len(x.findings) > 10:
            lines.append(f"           - ... and {len(x.findings) - 10} more runs of faulty rows")
    if len(shown) < len(r.samples):
        lines.append(f"  ({len(r.samples) - len(shown):,} samples not listed; --json lists every sample)")
    bad = [x for x in r.samples if x.findings]
    columns = [s for s in r.sources if s.matches is not None]
    lines.append(f"checked {len(r.samples):,} of {r.samples_total:,} samples, {r.rows:,} rows x {len(r.sources)} column "
                 f"source(s) = {r.row_checks:,} row checks in {r.seconds:.1f} s ({r.rows_per_s:,.0f} rows/s; "
                 f"{r.check_rows_per_s:,.0f} rows/s after {r.load_seconds:.1f} s of loading)")
    if r.ok:
        lines.append("recompute: OK")
    else:
        kinds = {}
        for x in bad:
            kinds[x.verdict] = kinds.get(x.verdict, 0) + 1
        parts = [f"{n} sample(s) {k}" for k, n in kinds.items()]
        parts += [f"column {s.column!r} source {s.source} holds {s.matches}" for s in columns]
        lines.append("recompute: FAILED (" + ", ".join(parts) + ")")
    return "\n".join(lines)
