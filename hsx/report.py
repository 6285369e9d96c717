"""Plain-text renderings of inspect summaries, verify reports and run summaries for the CLI."""

from __future__ import annotations


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def format_inspect(s: dict) -> str:
    lines = [
        f"{s['path']}",
        f"  samples       {s['samples']:,} in {s['shards']} shard(s)"
        + (f", {s['errors']} error record(s)" if s["errors"] else "")
        + ("" if s["complete"] in (None, True) else "  [incomplete run: resume to finish]"),
        f"  tokens        {s['tokens']:,} ({s['prompt_tokens']:,} prompt + {s['completion_tokens']:,} completion)",
        f"  rows/column   {s['rows_per_column']:,}   mode {s['mode']}",
        f"  size          {_mb(s['bytes'])}, {s['bytes_per_token']:,.0f} bytes/token",
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
    return "\n".join(lines)


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
        lines.append(f"  ignored  {name} (not in the manifest: a leftover of an interrupted write; readers skip it)")
    if r.errors:
        lines.append(f"  note   {r.errors} sample(s) recorded as input errors (see manifest.json 'errors')")
    bad = sum(1 for s in r.shards if s.faults) + (1 if r.faults else 0)
    lines.append("verify: OK" if r.ok else f"verify: FAILED ({bad} shard(s) or manifest with faults)")
    return "\n".join(lines)


def format_run(s) -> str:
    rate = s.tokens / s.seconds if s.seconds else 0.0
    lines = [
        f"wrote {s.samples:,} samples ({s.tokens:,} tokens, {s.completion_tokens:,} generated, {s.rows:,} rows per column) "
        f"to {s.output} in {s.seconds:.1f} s ({rate:,.0f} tokens/s)",
        f"  shards on disk: {s.bytes / 1e6:,.1f} MB in total",
    ]
    if s.workers:
        lines.append(f"  ray: {s.workers} workers" + (f"; {s.retried} unit(s) retried on another worker after "
                                                      "theirs was lost" if s.retried else ""))
    if s.resumed:
        lines.append(f"  resumed: {s.resumed:,} samples were already done and were skipped")
    if s.errors:
        lines.append(f"  input errors: {s.errors:,} samples recorded in manifest.json 'errors' (see hsx inspect)")
    if s.mean_accept_len is not None:
        lines.append(f"  speculative: mean accept length {s.mean_accept_len:.2f} over {s.verify_steps:,} verify steps")
    return "\n".join(lines)
