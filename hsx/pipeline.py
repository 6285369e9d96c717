"""``hsx extract``: dataset -> batches -> engine -> alignment -> shards, resumable from the manifest."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from hsx.config import ExtractConfig
from hsx.errors import HsxError, SampleError, ShardError
from hsx.shards.format import build_metadata, config_sha256
from hsx.shards.lock import LOCK, OutputLock
from hsx.shards.positions import sample_positions
from hsx.shards.manifest import (CONFIG, LEGACY_CONFIG, LEGACY_MANIFEST, MANIFEST, Manifest, atomic_write_bytes,
                                 load_manifest, manifest_path, save_manifest)
from hsx.shards.background import BackgroundSink
from hsx.shards.writer import Record, ShardSink


@dataclass
class RunSummary:
    output: str
    samples: int = 0  # written by this run
    resumed: int = 0  # already in the output (written or recorded as errors) and skipped
    errors: int = 0  # error records made by this run (bad input, or a sample the engine gave up on)
    tokens: int = 0
    completion_tokens: int = 0
    rows: int = 0
    verify_steps: int = 0
    accepted: int = 0
    bytes: int = 0
    seconds: float = 0.0
    workers: int = 0  # Ray workers (0: this process ran the engine)
    retried: int = 0  # units sent to another worker after theirs was lost
    writer_blocked_s: float = 0.0  # the engine's thread waited this long for the shard writer (backpressure)
    writer_busy_s: float = 0.0  # the shard writer's thread spent this long encoding and writing

    def count(self, sample, rows: int) -> None:
        completion = sample.input_ids.numel() - sample.prompt_len
        self.samples += 1
        self.tokens += sample.input_ids.numel()
        self.completion_tokens += completion
        self.rows += rows  # stored rows (--keep may store fewer than the engine produced)
        if sample.accept_lens is not None:
            self.verify_steps += sample.accept_lens.numel()
            self.accepted += int(sample.accept_lens.sum())
        elif sample.verify_steps:  # count only: every completion token after the first came from a step
            self.verify_steps += sample.verify_steps
            self.accepted += completion - 1

    @property
    def mean_accept_len(self) -> float | None:
        return self.accepted / self.verify_steps if self.verify_steps else None


def differences(old, new, prefix: str = "") -> list[str]:
    """``field: old -> new`` for every leaf field that differs between two JSON-like dicts."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += differences(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    if old == new:
        return []
    return [f"{prefix[:-1]}: {_short(old)} -> {_short(new)}"]


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _saved_config(out: Path) -> dict | None:
    try:
        return json.loads((out / CONFIG).read_text())
    except (OSError, ValueError):
        return None


def _config_refusal(out: Path, m: Manifest, cfg: ExtractConfig) -> HsxError:
    saved = _saved_config(out)
    if saved is None:
        what = f"config hash {m.config_hash}, this run {cfg.fingerprint()}; {out / CONFIG} is missing or unreadable"
    else:
        ignore = set(ExtractConfig._LAYOUT_ONLY)
        new = {k: v for k, v in cfg.to_dict().items() if k not in ignore}
        diff = differences({k: v for k, v in saved.items() if k not in ignore}, new)
        what = "; ".join(diff) if diff else f"config hash {m.config_hash}, this run {cfg.fingerprint()}"
    return HsxError(f"{out} holds a run with a different configuration ({what}). "
                    "Use a new --output, or --overwrite to replace it.")


def _prepare_output(out: Path, cfg: ExtractConfig, overwrite: bool) -> Manifest | None:
    """The manifest to resume from, or None for a fresh run; refuses a different config.

    An output whose manifest commits nothing yet (a run stopped before its first shard, e.g. by a
    dataset it could not read) holds nothing to lose: a new run replaces it without ``--overwrite``.
    """
    if manifest_path(out).exists():
        m = load_manifest(out)
        if m.config_hash == cfg.fingerprint() and not overwrite:
            return m
        if not overwrite and m.shards:
            raise _config_refusal(out, m, cfg)
        overwrite = True
    elif out.exists() and any(p.name != LOCK for p in out.iterdir()) and not overwrite:
        raise HsxError(f"{out} exists, is not empty and has no {MANIFEST}; refusing to write into it (use --overwrite)")
    if overwrite and out.exists():
        for p in out.iterdir():
            if p.name in (MANIFEST, CONFIG, LEGACY_MANIFEST, LEGACY_CONFIG) or p.name.startswith(("shard-", ".shard-", f".{MANIFEST}", f".{LEGACY_MANIFEST}")):
                p.unlink() if p.is_file() else shutil.rmtree(p)
    return None


def _sha(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe_model(path: str, model_config, shape) -> dict:
    return {
        "path": path,
        "model_type": getattr(model_config, "model_type", None),
        "config_sha256": config_sha256(model_config),
        "revision": getattr(model_config, "_commit_hash", None),
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "hc_mult": shape.hc_mult,
    }


def _describe_tokenizer(cfg: ExtractConfig, tokenizer, chat_template: str | None) -> dict:
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    return {
        "path": cfg.model,
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "chat_template_sha256": _sha(template if isinstance(template, str) else json.dumps(template, sort_keys=True) if template else None),
        "chat_template_source": "file " + cfg.chat_template if cfg.chat_template else "tokenizer",
    }


def _windows(prompts: Iterator, size: int) -> Iterator[list]:
    """Lists of the ``(prompt, done)`` pairs whose source rows share a window ``[k * size, (k + 1) * size)``.

    A window never depends on which rows were skipped or where a work unit starts, so the engine
    schedules the same requests together for a sample in a fresh run, a resumed one and a Ray
    worker's unit: which requests share a forward changes the bits of the rows.
    """
    window, key = [], None
    for item in prompts:
        k = item[0].source_index // size
        if window and k != key:
            yield window
            window = []
        window.append(item)
        key = k
    if window:
        yield window


def _run_metadata(cfg: ExtractConfig, engine, chat_template: str | None, dataset_meta: dict) -> dict:
    sampling = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}
    return build_metadata(
        layers=[g.describe() for g in engine.groups],
        dtype=cfg.dtype,
        mode=cfg.mode,
        model=_describe_model(cfg.model, engine.model_config, engine.shape),
        tokenizer=_describe_tokenizer(cfg, engine.tokenizer, chat_template),
        engine=engine.describe(),
        speculative=engine.describe_speculative(),
        dataset=dataset_meta,
        keep=cfg.keep,
        codec=cfg.compression,
        sampling=sampling if cfg.mode == "generate" else None,
        config_hash=cfg.fingerprint(),
    )


def _pending_prompts(rows, renderer, done: set[str], sink: ShardSink, summary: RunSummary, bar) -> Iterator:
    """``(prompt, done)`` for the rendered rows of ``(index, row)`` pairs, ``done`` when the output
    already holds the sample; bad rows and repeated ids become error records instead."""
    seen: set[str] = set()
    for index, row in rows:
        try:
            p = renderer.render(row, index)
        except SampleError as e:
            if e.sample_id in done:
                summary.resumed += 1
            else:
                sink.add_error(e.sample_id, index, e.reason)
                summary.errors += 1
            bar.update(1)
            continue
        if p.sample_id in seen:
            if p.sample_id in done:
                summary.resumed += 1
            else:
                sink.add_error(p.sample_id, index, f"duplicate sample id {p.sample_id!r} (also at an earlier row)")
                summary.errors += 1
            bar.update(1)
            continue
        seen.add(p.sample_id)
        yield p, p.sample_id in done


def _record(prompt, sample, mode: str, keep: str) -> Record:
    loss_mask = torch.tensor(prompt.loss_mask, dtype=torch.uint8)
    if mode == "generate":  # the renderer masks the prompt; every generated token is learned
        completion = sample.input_ids.numel() - sample.prompt_len
        loss_mask = torch.cat([loss_mask, torch.ones(completion, dtype=torch.uint8)])
    hidden = sample.hidden
    if keep != "all":  # rows of the other positions are dropped here, by the rule readers apply again
        sample.wait()  # (on CUDA the host copies may still be in flight)
        pos = torch.from_numpy(sample_positions(keep, mode, sample.input_ids.numel(), sample.prompt_len, loss_mask.numpy()))
        hidden = {name: h[pos] for name, h in hidden.items()}
    return Record(prompt.sample_id, prompt.source_index, sample.input_ids, sample.prompt_len, loss_mask,
                  sample.finish_reason, hidden, sample.accept_lens, sample.verify_steps, ready=sample.ready)


def make_renderer(cfg: ExtractConfig, engine, column_names) -> tuple:
    """The renderer for ``cfg`` over a dataset with these columns, and the chat template text (or None)."""
    from hsx.data.render import Renderer

    chat_template = Path(cfg.chat_template).read_text() if cfg.chat_template else None
    renderer = Renderer(
        engine.tokenizer, cfg.mode, text_field=cfg.text_field, id_field=cfg.id_field,
        chat_template=chat_template, max_length=cfg.max_length or engine.context_length, split=cfg.split,
    )
    renderer.detect(column_names)
    return renderer, chat_template


def check_resume(out: Path, resume: Manifest | None, metadata: dict) -> Manifest | None:
    """The manifest to resume from, refusing one whose run had other metadata; one that committed
    nothing yet holds nothing to lose, so the run starts afresh instead."""
    if resume is None or resume.metadata == metadata:
        return resume
    if resume.shards:
        differs = "; ".join(differences(resume.metadata, metadata)[:8])
        raise HsxError(f"{out}: the model, tokenizer, dataset or engine differ from the run being resumed "
                       f"({differs}); use a new --output or --overwrite")
    return None


def run_prompts(engine, prompts: Iterator, sink: ShardSink, summary: RunSummary, cfg: ExtractConfig, after_sample) -> None:
    """Drive the engine over ``(prompt, done)`` pairs one window of ``cfg.window_rows`` source rows at a time.

    The engine schedules a window as it likes (length order, continuous batching) and hands back
    each result as it finishes; every one goes to ``sink``. A window whose samples are all in the
    output is skipped; one that is only partly there (a run stopped inside it) is run whole again
    and the samples already written are dropped, so every stored row has the bits a fresh run gives.
    """
    for window in _windows(prompts, cfg.window_rows):
        written = {p.sample_id for p, done in window if done}
        summary.resumed += len(written)
        after_sample(len(written))
        if len(written) == len(window):
            continue
        for prompt, sample in engine.stream([p for p, _ in window]):
            if prompt.sample_id in written:
                continue
            if isinstance(sample, SampleError):  # an engine may give up on one sample and go on
                sink.add_error(prompt.sample_id, prompt.source_index, sample.reason)
                summary.errors += 1
            else:
                record = _record(prompt, sample, cfg.mode, cfg.keep)
                sink.add(record)
                summary.count(sample, record.num_rows)
            after_sample(1)


def extract(cfg: ExtractConfig, *, overwrite: bool = False, progress: bool = True) -> RunSummary:
    """Run an extraction described by ``cfg``; resumes an interrupted run into the same output.

    The output directory is locked for the whole run (:class:`~hsx.shards.lock.OutputLock`).
    With ``cfg.ray`` the work is spread over Ray workers (:mod:`hsx.scale`).
    """
    cfg.validate()
    if cfg.ray:
        from hsx.scale import extract_ray

        return extract_ray(cfg, overwrite=overwrite, progress=progress)
    out = Path(cfg.output)
    with OutputLock(out):
        return _extract_here(cfg, out, overwrite, progress)


def _extract_here(cfg: ExtractConfig, out: Path, overwrite: bool, progress: bool) -> RunSummary:
    from hsx.data.load import describe, load_rows
    from hsx.engine.loader import build_engine

    resume = _prepare_output(out, cfg, overwrite)
    t0 = time.perf_counter()

    rows_all = load_rows(cfg.dataset, cfg.split)
    dataset_meta = describe(rows_all, cfg.dataset, cfg.split)  # before --limit: a resume may change it
    rows = rows_all.select(range(min(cfg.limit, len(rows_all)))) if cfg.limit is not None else rows_all

    engine = build_engine(cfg)
    renderer, chat_template = make_renderer(cfg, engine, rows.column_names)
    metadata = _run_metadata(cfg, engine, chat_template, dataset_meta)
    resume = check_resume(out, resume, metadata)
    manifest = resume or Manifest(metadata=metadata, config_hash=cfg.fingerprint())
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / CONFIG, json.dumps(cfg.to_dict(), indent=1).encode())
    if resume is None:
        save_manifest(out, manifest)

    summary = RunSummary(str(out))
    # shards are encoded and written on a thread of their own, behind a bounded queue
    sink = BackgroundSink(out, manifest, max_shard_bytes=cfg.max_shard_mb << 20,
                          max_shard_samples=cfg.max_shard_samples)
    bar = tqdm(total=len(rows), unit="sample", disable=not progress, dynamic_ncols=True)
    prompts = _pending_prompts(enumerate(rows), renderer, manifest.done_ids(), sink, summary, bar)

    def after_sample(n: int) -> None:
        bar.update(n)
        bar.set_postfix(tok_s=f"{summary.tokens / (time.perf_counter() - t0):,.0f}", errors=summary.errors, refresh=False)

    try:
        run_prompts(engine, prompts, sink, summary, cfg, after_sample)
    except BaseException:  # Ctrl-C, or an error: everything finished so far becomes durable
        try:
            sink.close(complete=False)
        except ShardError:
            pass  # the writer's own failure, raised already or behind the error being raised
        finally:
            bar.close()
        raise
    sink.close(complete=True)
    bar.close()
    summary.writer_blocked_s, summary.writer_busy_s = sink.stats.blocked_s, sink.stats.busy_s
    summary.seconds = time.perf_counter() - t0
    summary.bytes = sum((out / s.file).stat().st_size for s in manifest.shards)
    return summary
