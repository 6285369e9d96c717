"""``hsx verify --recompute``: every stored row of every column against an independent forward.

``recompute(path)`` reads shards; ``check_samples(reference, samples, groups, tol)`` checks
samples already in memory (an engine's ``AlignedSample`` or a shard ``Sample``), for scripts
that want the same verdicts without writing shards. Samples longer than the chunk setting are
checked alone, a chunk of tokens at a time (:mod:`hsx.recompute.chunked`).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from hsx.align import LayerGroup
from hsx.errors import HsxError
from hsx.recompute import rows as R
from hsx.recompute.chunked import check_in_chunks
from hsx.recompute.images import DatasetRows, VisionReference
from hsx.compare.check import Tolerance, check_segment
from hsx.recompute.reference import Reference, neighbour_sources, same_width
from hsx.shards.format import config_matches
from hsx.recompute.results import RecomputeReport, SampleResult, SourceResult, findings_of, source_label
from hsx.compare.tolerance import tolerance_for

# --recompute-chunk auto: samples longer than AUTO_CHUNK tokens are checked in chunks of AUTO_CHUNK, or
# fewer tokens for very long samples, so that a chunk's causal mask [chunk, tokens] (~5 bytes an entry
# on the CPU: transformers' boolean mask and the float copy attention makes of it) stays within
# AUTO_MASK_ENTRIES entries (160 MiB); never fewer than AUTO_MIN_CHUNK (docs/PERFORMANCE.md, "Long samples")
AUTO_CHUNK = 2048
AUTO_MASK_ENTRIES = 1 << 25
AUTO_MIN_CHUNK = 256


def resolve_chunk(chunk: int | str | None) -> int | str | None:
    """The chunk setting: ``"auto"``, None (every sample in one forward; also ``"off"``) or N >= 1 tokens."""
    if chunk == "auto":
        return chunk
    if chunk is None or chunk == "off":
        return None
    if isinstance(chunk, str) and chunk.strip().isdigit():
        chunk = int(chunk)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise HsxError(f"the recompute chunk must be auto, off or a number of tokens >= 1, got {chunk!r}")
    return chunk


def chunk_for(chunk: int | str | None, tokens: int) -> int | None:
    """The chunk a sample of ``tokens`` tokens is checked in under the setting ``chunk`` (None: in its batch's
    forward). ``"auto"``: samples of more than :data:`AUTO_CHUNK` tokens, in chunks of at most AUTO_CHUNK
    tokens and at most :data:`AUTO_MASK_ENTRIES` / ``tokens`` (at least :data:`AUTO_MIN_CHUNK`)."""
    if chunk == "auto":
        if tokens <= AUTO_CHUNK:
            return None
        return max(AUTO_MIN_CHUNK, min(AUTO_CHUNK, AUTO_MASK_ENTRIES // tokens))
    return chunk if chunk is not None and tokens > chunk else None


def _stored_block(samples, placed: list[torch.Tensor], name: str, width: int, length: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """Column ``name`` of every sample, each row at its position ``placed[i]``: ``[B, T, W]`` float32 and
    ``valid [B, T]``."""
    block = torch.zeros(len(samples), length, width, device=device)
    valid = torch.zeros(len(samples), length, dtype=torch.bool, device=device)
    for i, (s, pos) in enumerate(zip(samples, placed)):
        rows = R.hidden(s, name)[: len(pos)]  # rows beyond the positions have no state to compare with
        at = pos[: rows.shape[0]].to(device)
        block[i, at] = rows.to(device=device, dtype=torch.float32)
        valid[i, at] = True
    return block, valid


def check_samples(
    reference: Reference | torch.nn.Module,
    samples: Sequence,
    groups: Sequence[LayerGroup],
    tol: Tolerance,
    mode: str = "generate",
    sources: dict[tuple[str, int | str], SourceResult] | None = None,
    chunk: int | str | None = None,
) -> list[SampleResult]:
    """Check one batch of samples (each with ``input_ids [N]`` and hidden rows per column).

    A shard ``Sample``'s rows are checked at its ``positions`` (what ``--keep`` stored); other samples'
    row j is position j, every position ``mode`` covers. A sample longer than ``chunk`` tokens is
    checked alone, ``chunk`` tokens at a time (:mod:`hsx.recompute.chunked`; ``"auto"``: see
    :func:`chunk_for`); the others in one batched forward (all of them when ``chunk`` is None).

    ``sources``, when given, accumulates per-column-source statistics across calls.
    """
    ref = reference if isinstance(reference, Reference) else Reference.wrap(reference)
    for g in groups:
        widths = [ref.shape.width_of(s) for s in g.sources]
        if g.width != sum(widths):
            raise HsxError(f"column {g.name!r} is {g.width} wide for sources {list(g.sources)}; the model's states "
                           f"are {' + '.join(map(str, widths))} wide")
    chunk = None if isinstance(ref, VisionReference) and chunk == "auto" else resolve_chunk(chunk)
    sizes = [chunk_for(chunk, R.token_ids(s).numel()) for s in samples]
    short = [k for k, size in enumerate(sizes) if size is None]
    results: list[SampleResult | None] = [None] * len(samples)
    if short:
        checked = _check_batch(ref, [samples[k] for k in short], [R.sample_id(samples[k], k) for k in short], groups,
                               tol, mode, sources)
        for k, r in zip(short, checked):
            results[k] = r
    for k, size in enumerate(sizes):
        if size is not None:
            results[k] = check_in_chunks(ref, samples[k], k, groups, tol, mode, size, sources)
    return results


def _check_batch(ref: Reference, samples: Sequence, sample_ids: list[str], groups: Sequence[LayerGroup],
                 tol: Tolerance, mode: str, sources: dict | None) -> list[SampleResult]:
    """Check samples in one right-padded forward over all of them."""
    num_layers = ref.shape.num_layers
    ids = [R.token_ids(s) for s in samples]
    n_tokens = torch.tensor([t.numel() for t in ids])
    length = int(n_tokens.max())
    wanted = [src for g in groups for src in (*g.sources, *neighbour_sources(g.sources, num_layers))]
    states, input_findings = ref.sample_states(samples, ids, wanted, sample_ids)
    results = [SampleResult(sid, 0) for sid in sample_ids]
    for i, found in input_findings.items():
        results[i].findings += found
    placed = [R.positions(s, mode) for s in samples]
    for i, s in enumerate(samples):
        got, want = R.num_rows(s, groups[0].name) if groups else 0, len(placed[i])
        results[i].rows = min(got, want)
        count = R.count_finding(sample_ids[i], groups[0].name, got, want, int(n_tokens[i]), mode) if groups else None
        if count is not None:
            results[i].findings.append(count)
    for g in groups:
        block, valid = _stored_block(samples, placed, g.name, g.width, length, ref.device)
        for src, (a, b) in zip(g.sources, ref.shape.spans(g.sources)):
            alts = same_width(ref.shape, src, neighbour_sources([src], num_layers))
            labels = [source_label(x, num_layers) for x in (src, *alts)]
            check = check_segment(block[:, :, a:b], valid, states[src], [states[x] for x in alts], n_tokens, tol)
            if sources is not None:
                sources.setdefault((g.name, src), SourceResult(g.name, src)).add(check, labels)
            worst_rel = check.rel.nan_to_num(nan=float("inf")).amax(1).tolist()  # [B] per-sample summaries
            worst_cos = check.cos.nan_to_num(nan=-1.0).amin(1).tolist()
            for i, r in enumerate(results):
                r.worst_rel, r.worst_cos = max(r.worst_rel, worst_rel[i]), min(r.worst_cos, worst_cos[i])
                r.findings += findings_of(check, i, sample_ids, g.name, src, labels, tol)
    return results


def _select(total: int, samples: int | None, seed: int) -> np.ndarray:
    if samples is None or samples >= total:
        return np.arange(total)
    if samples < 1:
        raise HsxError(f"--samples must be >= 1, got {samples}")
    return np.sort(np.random.default_rng(seed).choice(total, size=samples, replace=False))


def _load_reference(meta: dict, model: str | None, device: str, dtype: str, force: bool, trust_remote_code: bool,
                    found=None, vision: bool = False):
    from transformers import AutoConfig

    from hsx.device import compute_dtype, resolve_device

    recorded = meta.get("model") or {}
    path = model or (str(found) if found is not None else recorded.get("path"))  # found: from any directory
    if not path:
        raise HsxError("the shards do not name their model (metadata model.path): give --model")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise HsxError(f"cannot read the config of model {path!r}: {e}") from None
    if not force and not config_matches(config, recorded):
        raise HsxError(f"model {path!r} has a different config from the one the shards were made with "
                       f"(config_sha256 {recorded.get('config_sha256')!r} recorded for {recorded.get('path')!r}); "
                       "point --model at that model, or --force to compare anyway")
    dev = resolve_device(device)
    loader = VisionReference.load if vision else Reference.load  # vision: re-reads each sample's images
    ref = loader(path, dev, compute_dtype(dtype, dev), trust_remote_code)
    for key, have in (("num_layers", ref.shape.num_layers), ("hidden_size", ref.shape.hidden_size)):
        if recorded.get(key) is not None and int(recorded[key]) != have:
            raise HsxError(f"model {path!r} has {key} {have}; the shards were made with {recorded[key]}")
    return path, ref


def recompute(
    path,
    *,
    model: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    samples: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    rtol: float | None = None,
    force: bool = False,
    trust_remote_code: bool = False,
    progress: bool = True,
    chunk: int | str | None = "auto",
    dataset: str | None = None,
) -> RecomputeReport:
    """Re-run a teacher-forced forward of the shards' model over their tokens and check every stored row.

    ``model`` points at another copy of the model (its config must match unless ``force``);
    ``samples`` checks that many, chosen with ``seed``; batches follow storage order, so rows
    swapped between neighbouring samples are caught with the sample they belong to. ``chunk``: samples
    longer than this many tokens are checked alone, this many tokens at a time, their memory bounded
    by the chunk (``"auto"``: :func:`chunk_for`; ``None`` or ``"off"``: every sample in one forward).
    ``dataset``: where the run's dataset is now, for a vision-language output whose images came from its
    columns (default: the source the metadata records).
    """
    from hsx.shards.reader import open_shards

    t0 = time.perf_counter()
    chunk = resolve_chunk(chunk)
    ds = open_shards(path)
    meta = ds.metadata
    vision = bool(meta.get("vision"))
    if vision and chunk is not None and chunk != "auto":
        raise HsxError(f"--recompute-chunk {chunk}: a vision-language output is recomputed one whole sample per "
                       "forward (its images go in whole); leave it at auto")
    if vision:
        chunk = None
    groups = [LayerGroup.from_description(g) for g in meta["layers"]]
    model_path, ref = _load_reference(meta, model, device, dtype, force, trust_remote_code, ds.model_path(), vision)
    if vision:
        ref.dataset_row = DatasetRows(meta.get("dataset"), dataset)  # opened only for an image from a column
    compute = str(ref.dtype).removeprefix("torch.")
    engine_dtype = (meta.get("engine") or {}).get("compute_dtype")
    tol = tolerance_for(meta["dtype"], engine_dtype, compute, rtol, recurrent=ref.recurrent)
    report = RecomputeReport(str(path), model_path, str(ref.device), compute, meta["dtype"], engine_dtype,
                             tol.describe(), len(ds), load_seconds=time.perf_counter() - t0, chunk=chunk)
    chosen = _select(len(ds), samples, seed)
    stats: dict = {}
    bar = tqdm(total=len(chosen), unit="sample", disable=not progress, dynamic_ncols=True, desc="recompute")
    for start in range(0, len(chosen), max(1, batch_size)):
        batch = [ds[int(k)] for k in chosen[start:start + batch_size]]
        results = check_samples(ref, batch, groups, tol, meta["mode"], stats, chunk)
        report.samples += results
        lengths = [len(s.input_ids) for s in batch]
        report.tokens += sum(lengths)
        report.chunked_samples += sum(chunk_for(chunk, n) is not None for n in lengths)
        bar.update(len(batch))
        bar.set_postfix(bad=sum(1 for r in report.samples if r.findings), refresh=False)
    bar.close()
    report.sources = list(stats.values())
    for s in report.sources:
        s.finish(tol.margin)
    report.rows = sum(r.rows for r in report.samples)
    report.row_checks = sum(s.rows for s in report.sources)
    report.seconds = time.perf_counter() - t0
    return report
