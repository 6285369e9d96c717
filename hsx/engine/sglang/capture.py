"""hsx's hidden-state capture inside SGLang's scheduler process: rows leave as raw bytes, never float lists.

The only hsx module that reaches into SGLang internals. Two halves:

- **In the scheduler process** (:func:`install`, loaded through SGLang's ``forward_hooks`` server
  argument, whose ``hook_factory`` SGLang imports and calls in every model runner's process at
  start-up). It wraps two methods of SGLang's result processor and one of its batch result, all
  in Python that runs after the forward, so the capture is the same with or without CUDA-graph
  replay (a forward hook would not fire during replay). It registers no forward hook.

  * ``SchedulerBatchResultProcessor.process_batch_result_prefill``: cuts each request's prompt block
    out of the batch's ``[sum(extend lens), W]`` rows;
  * ``SchedulerBatchResultProcessor.process_batch_result_decode``: cuts each request's accepted rows
    out of the ``[batch * stride, W]`` verify output (request i: rows ``[i*stride, i*stride +
    accept_len_i)``) with the same mask as the step's committed tokens
    (:func:`hsx.align.slice_verify_step`);
  * ``GenerationBatchResult.copy_to_cpu`` (overlap scheduling): also starts the device-to-host copy
    of ``last_hidden_states`` and ``accept_index``, before SGLang records its copy-done event.

  Each wrapper appends the step's records to one file per request (``<dir>/<rid>.rows``) *before*
  calling SGLang's method, which streams a finished request out: a response never arrives before its
  rows. It then sets ``logits_output.hidden_states`` to None for the call, so SGLang's own
  ``.tolist()`` path (``_append_prefill_hidden_states`` / ``_append_decode_hidden_states``) is never
  taken and ``meta_info["hidden_states"]`` comes back empty. Nothing is held between steps.

- **In hsx's process** (:func:`read_records`): a request's file parsed with ``numpy.frombuffer``.

Record layout (little-endian): ``int64[3] = kind, n_rows, n_tokens``; then ``int64[n_tokens]``
tokens; then, per column in the capture spec's order, ``n_rows x width`` values of the spec's dtype
(bfloat16 as its raw bits). Kinds: 0 prefill block (its tokens: the first completion token),
1 decode/verify step (its tokens: the step's committed tokens, one per row), 2 an error found in
the scheduler (``n_tokens`` bytes of UTF-8 text, no rows).

Sources: ``hidden`` is ``logits_output.hidden_states`` (the final-norm output, or the aux
concatenation under aux capture / EAGLE3); ``last`` is ``logits_output.last_hidden_states``, the
post-norm final state SGLang keeps next to the aux states under full aux capture. For trees SGLang
moves only ``hidden`` to the front of each stride; ``last`` is moved here with the step's
``accept_index``, the same gather.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hsx.align.rows import slice_verify_step
from hsx.errors import HsxError

TESTED = ("0.5.23",)  # SGLang releases whose wrapped functions were read and checked on the lane
HOOK_FACTORY = "hsx.engine.sglang.capture:install"
PREFILL, STEP, ERROR = 0, 1, 2
SOURCES = ("hidden", "last")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_RID = re.compile(r"^[A-Za-z0-9_.-]+$")
_installed: dict | None = None


def check_version(version: str) -> None:
    """Refuse an SGLang release whose internals this module has not been checked against."""
    base = str(version).split("+")[0]
    if base not in TESTED and not any(base.startswith(v + ".post") for v in TESTED):
        raise HsxError(f"--sglang-capture tensors wraps SGLang internals checked on SGLang {', '.join(TESTED)} only; "
                       f"SGLang {version} is installed. Use --sglang-capture lists (SGLang's own float lists, slower) "
                       f"or install sglang=={TESTED[-1]}")


# ---- the capture spec, shared by both halves -------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One stored column: ``pieces`` are ``(source, start, end)`` width slices, concatenated in order."""

    name: str
    pieces: tuple[tuple[str, int, int], ...]

    @property
    def width(self) -> int:
        return sum(b - a for _, a, b in self.pieces)


@dataclass(frozen=True)
class CaptureSpec:
    dir: str
    prefix: str  # only requests whose rid starts with it are captured
    dtype: str
    columns: tuple[Column, ...]
    widths: dict[str, int]  # source -> the row width SGLang must return (checked, never reshaped)
    tree: bool  # SGLang moved the accepted tree path of ``hidden`` to the front; ``last`` needs the same

    def to_config(self) -> dict:
        return {"dir": self.dir, "prefix": self.prefix, "dtype": self.dtype, "tree": self.tree,
                "widths": dict(self.widths),
                "columns": [{"name": c.name, "pieces": [list(p) for p in c.pieces]} for c in self.columns]}

    @staticmethod
    def from_config(d: dict) -> "CaptureSpec":
        cols = tuple(Column(c["name"], tuple((str(s), int(a), int(b)) for s, a, b in c["pieces"])) for c in d["columns"])
        for c in cols:
            bad = [p for p in c.pieces if p[0] not in d["widths"] or not 0 <= p[1] < p[2] <= int(d["widths"][p[0]])]
            if bad:
                raise HsxError(f"capture column {c.name!r}: bad pieces {bad} (sources {SOURCES})")
        if d["dtype"] not in DTYPES:
            raise HsxError(f"capture dtype {d['dtype']!r}: expected one of {sorted(DTYPES)}")
        widths = {str(k): int(v) for k, v in d["widths"].items()}
        unknown = sorted(set(widths) - set(SOURCES))
        if unknown:
            raise HsxError(f"capture sources {unknown}: expected some of {SOURCES}")
        return CaptureSpec(str(d["dir"]), str(d["prefix"]), d["dtype"], cols, widths, bool(d["tree"]))

    def hook(self) -> dict:
        """The ``forward_hooks`` entry that loads the capture into SGLang's scheduler process."""
        # SGLang skips a spec without target_modules before calling its factory; the factory
        # installs the capture and returns None, so no module gets a hook.
        return {"name": "hsx-capture", "target_modules": ["lm_head"], "hook_factory": HOOK_FACTORY,
                "config": self.to_config()}

    def path(self, rid: str) -> Path:
        if not _RID.match(rid):
            raise HsxError(f"request id {rid!r} cannot name a capture file")
        return Path(self.dir) / f"{rid}.rows"


# ---- scheduler side: cutting and writing ---------------------------------------------------------


class Writer:
    """Appends a request's records to its file; holds nothing between calls."""

    def __init__(self, spec: CaptureSpec):
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]

    def ours(self, req) -> bool:
        return bool(req.return_hidden_states) and str(req.rid).startswith(self.spec.prefix)

    def columns(self, sources: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Each column ``[rows, W]`` as one CPU tensor of the stored dtype."""
        for name, width in self.spec.widths.items():
            src = sources.get(name)
            if src is None or src.dim() != 2 or src.shape[1] != width:
                have = None if src is None else tuple(src.shape)
                raise HsxError(f"SGLang's {name!r} rows have shape {have}, expected [rows, {width}] (hidden x K for "
                               "aux capture, x hc_mult for hyper-connections; never reshaped)")
        if len({sources[n].shape[0] for n in self.spec.widths}) != 1:
            raise HsxError(f"SGLang's outputs have different row counts: "
                           f"{ {n: sources[n].shape[0] for n in self.spec.widths} }")
        out = {}
        for col in self.spec.columns:
            parts = [sources[s][:, a:b] for s, a, b in col.pieces]
            block = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
            out[col.name] = block.to(device="cpu", dtype=self.dtype)
        return out

    def append(self, rid: str, kind: int, rows: dict[str, torch.Tensor], tokens: torch.Tensor) -> None:
        """One record onto the request's file: one ``writev`` of views (the rows are already on the host)."""
        n = next(iter(rows.values())).shape[0]
        ids = tokens.to("cpu", torch.int64).numpy().astype("<i8", copy=False)
        head = np.array([kind, n, ids.size], dtype="<i8")
        _append(self.spec.path(rid), [head, ids, *(_raw(rows[col.name]) for col in self.spec.columns)])

    def error(self, rid: str, message: str) -> None:
        text = message.encode()
        _append(self.spec.path(rid), [np.array([ERROR, 0, len(text)], dtype="<i8"), text])

    def _columns_or_errors(self, reqs: Sequence, sources: dict, where: str) -> dict | None:
        """The step's columns, or None after an error record for each of our requests in it."""
        try:
            return self.columns(sources)
        except HsxError as e:
            for req in reqs:
                if self.ours(req):
                    self.error(req.rid, f"{where}: {e}")
            return None

    def prefill(self, reqs: Sequence, sources: dict, extend_lens: Sequence[int], next_ids: torch.Tensor,
                commits: Sequence[bool]) -> None:
        """One extend batch: request i owns rows ``[offset_i, offset_i + extend_lens[i])``."""
        total = sum(int(n) for n in extend_lens)
        rows = sources["hidden"].shape[0]
        if rows != total:
            for req in reqs:
                if self.ours(req):
                    self.error(req.rid, f"prefill batch returned {rows} hidden rows for {total} extend tokens "
                                        "(full capture expected one row per prompt position)")
            return
        cols = self._columns_or_errors(reqs, sources, "prefill")
        if cols is None:
            return
        offset = 0
        for i, req in enumerate(reqs):
            n = int(extend_lens[i])
            if commits[i] and self.ours(req):
                self.append(req.rid, PREFILL, {k: v[offset:offset + n] for k, v in cols.items()}, next_ids[i:i + 1])
            offset += n

    def step(self, reqs: Sequence, sources: dict, tokens: torch.Tensor, accept_lens: torch.Tensor, stride: int,
             live: torch.Tensor, accept_index: torch.Tensor | None) -> None:
        """One decode/verify step: ``tokens`` ``[B, stride]``, ``accept_lens`` ``[B]``, ``live`` ``[B]`` bool."""
        batch = len(reqs)
        mine = torch.tensor([self.ours(r) for r in reqs], dtype=torch.bool)
        accept = torch.where(live & mine, accept_lens.to("cpu", torch.int64), 0)
        if not bool(accept.any()):
            return
        if self.spec.tree and sources.get("last") is not None and accept_index is not None:
            sources = {**sources, "last": front(sources["last"], accept_index, batch, stride)}
        cols = self._columns_or_errors([r for r, a in zip(reqs, accept.tolist()) if a], sources, "verify step")
        if cols is None:
            return
        cut = {k: slice_verify_step(v, accept, stride) for k, v in cols.items()}
        toks = slice_verify_step(tokens.to("cpu", torch.int64).reshape(-1, 1), accept, stride)
        for i, req in enumerate(reqs):
            if int(accept[i]):
                self.append(req.rid, STEP, {k: v[i] for k, v in cut.items()}, toks[i].reshape(-1))


def front(x: torch.Tensor, accept_index: torch.Tensor, batch: int, stride: int) -> torch.Tensor:
    """Move each request's accepted tree path (``accept_index`` ``[B, depth]``, -1 padded) to the front of its stride."""
    depth = accept_index.shape[1]
    picked = x[accept_index.to("cpu", torch.int64).clamp(min=0).reshape(-1)]  # [B * depth, W]
    out = x.clone()
    out.view(batch, stride, -1)[:, :depth] = picked.view(batch, depth, -1)
    return out


def _append(path: Path, parts: list) -> None:
    """``parts`` (buffers) appended to ``path`` in order, by ``writev`` (repeated after a short write)."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while views:
            done = os.writev(fd, views)
            while views and done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            if views:
                views[0] = views[0][done:]
    finally:
        os.close(fd)


def _raw(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


# ---- scheduler side: SGLang glue -----------------------------------------------------------------


def install(config: dict):
    """SGLang ``hook_factory``: wrap the result processor once per process; returns None (no forward hook)."""
    global _installed
    import sglang

    check_version(sglang.__version__)
    spec = CaptureSpec.from_config(config)
    if _installed is not None:
        if _installed != spec.to_config():
            raise HsxError("the hsx capture was installed twice with different specs in one SGLang process")
        return None
    from sglang.srt.managers import utils as mutils
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp

    if _writes_here():
        writer = Writer(spec)
        proc = brp.SchedulerBatchResultProcessor
        proc.process_batch_result_prefill = _wrap_prefill(proc.process_batch_result_prefill, writer)
        proc.process_batch_result_decode = _wrap_decode(proc.process_batch_result_decode, writer,
                                                        brp._get_speculative_output_stride)
    else:
        proc = brp.SchedulerBatchResultProcessor
        proc.process_batch_result_prefill = _wrap_silence(proc.process_batch_result_prefill)
        proc.process_batch_result_decode = _wrap_silence(proc.process_batch_result_decode)
    result_cls = mutils.GenerationBatchResult
    result_cls.copy_to_cpu = _wrap_copy(result_cls.copy_to_cpu, mutils._async_d2h)
    if any(p[0] == "last" for c in spec.columns for p in c.pieces):
        from sglang.srt.layers.logits_processor import LogitsProcessor

        LogitsProcessor._get_last_hidden_states_to_store = _wrap_keep_final(LogitsProcessor._get_last_hidden_states_to_store)
    _installed = spec.to_config()
    return None


def _writes_here() -> bool:
    """Only the first tensor-parallel rank writes (every rank holds the same rows)."""
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # no process group: a single rank
        return True


def _sync(result) -> None:
    if getattr(result, "copy_done", None) is not None:
        result.copy_done.synchronize()


def _sources(lo) -> dict:
    return {"hidden": lo.hidden_states, "last": getattr(lo, "last_hidden_states", None)}


def _without_lists(fn, self, batch, result):
    """Call SGLang's method with the hidden rows out of its reach (its list path is never taken)."""
    lo = result.logits_output
    kept = lo.hidden_states
    lo.hidden_states = None
    try:
        return fn(self, batch, result)
    finally:
        lo.hidden_states = kept


def _wrap_prefill(fn, writer: Writer):
    @functools.wraps(fn)
    def process_batch_result_prefill(self, batch, result):
        lo = getattr(result, "logits_output", None)
        if not (self.is_generation and batch.return_hidden_states and lo is not None and lo.hidden_states is not None):
            return fn(self, batch, result)
        _sync(result)
        commits = [not r.finished() and not r.is_retracted and r.inflight_middle_chunks <= 0 for r in batch.reqs]
        next_ids = torch.as_tensor(result.next_token_ids).reshape(-1).to("cpu")
        writer.prefill(batch.reqs, _sources(lo), result.extend_input_len_per_req, next_ids, commits)
        return _without_lists(fn, self, batch, result)

    return process_batch_result_prefill


def _wrap_decode(fn, writer: Writer, output_stride):
    @functools.wraps(fn)
    def process_batch_result_decode(self, batch, result):
        lo = result.logits_output
        if not (batch.return_hidden_states and lo is not None and lo.hidden_states is not None):
            return fn(self, batch, result)
        _sync(result)
        reqs, spec = batch.reqs, not batch.spec_algorithm.is_none()
        overlap = self.enable_overlap or self.enable_overlap_mlx
        # SGLang commits nothing for these (the overlap scheduler's extra tick of a finished request)
        live = torch.tensor([not (overlap and (r.finished() or r.is_retracted)) for r in reqs], dtype=torch.bool)
        if spec:
            stride = output_stride(result)
            accept = torch.as_tensor(result.accept_lens)
            accept_index = result.accept_index
        else:
            stride, accept, accept_index = 1, torch.ones(len(reqs), dtype=torch.int64), None
        tokens = torch.as_tensor(result.next_token_ids).reshape(len(reqs), stride)
        writer.step(reqs, _sources(lo), tokens, accept, stride, live, accept_index)
        return _without_lists(fn, self, batch, result)

    return process_batch_result_decode


def _wrap_silence(fn):
    """Ranks that do not write still keep the rows away from SGLang's list path."""
    @functools.wraps(fn)
    def wrapped(self, batch, result):
        lo = getattr(result, "logits_output", None)
        if lo is None or lo.hidden_states is None:
            return fn(self, batch, result)
        return _without_lists(fn, self, batch, result)

    return wrapped


def _wrap_keep_final(fn):
    """Keep the post-norm final state next to the aux states under full capture, with a draft running too.

    SGLang keeps it only for capture without a draft (``--enable-return-aux-hidden-states``). This
    runs in the Python forward, so a CUDA graph captured before the capture was installed does not
    have it: such steps come without ``last`` and are reported (see :meth:`Writer.columns`).
    """
    @functools.wraps(fn)
    def _get_last_hidden_states_to_store(self, hidden_states, aux_hidden_states, logits_metadata):
        kept = fn(self, hidden_states, aux_hidden_states, logits_metadata)
        if kept is None and aux_hidden_states is not None and logits_metadata.capture_hidden_mode.is_full():
            return hidden_states
        return kept

    return _get_last_hidden_states_to_store


def _wrap_copy(fn, d2h):
    @functools.wraps(fn)
    def copy_to_cpu(self, *args, **kwargs):
        lo = self.logits_output
        if lo is not None and getattr(lo, "last_hidden_states", None) is not None and lo.last_hidden_states.device.type != "cpu":
            lo.last_hidden_states = d2h(lo.last_hidden_states)
        if self.accept_index is not None and self.accept_index.device.type != "cpu":
            self.accept_index = d2h(self.accept_index)
        return fn(self, *args, **kwargs)  # records copy_done after every copy above

    return copy_to_cpu


# ---- hsx side: reading -----------------------------------------------------------------------


@dataclass
class Record:
    kind: int
    tokens: np.ndarray  # int64 [n_tokens]
    rows: dict[str, torch.Tensor]  # name -> [n_rows, W] (views of the file's bytes)
    message: str = ""


def read_records(spec: CaptureSpec, rid: str) -> list[Record]:
    """Parse ``<dir>/<rid>.rows``; a missing file is an empty list. Raises HsxError on a truncated file."""
    path = spec.path(rid)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    dtype = DTYPES[spec.dtype]
    item = torch.empty(0, dtype=dtype).element_size()
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    out, pos = [], 0
    while pos < len(data):
        if pos + 24 > len(data):
            raise HsxError(f"{path}: truncated record header at byte {pos}")
        kind, n, n_tok = (int(v) for v in np.frombuffer(data, "<i8", 3, pos))
        pos += 24
        if kind == ERROR:
            out.append(Record(kind, np.zeros(0, np.int64), {}, data[pos:pos + n_tok].decode(errors="replace")))
            pos += n_tok
            continue
        tokens = np.frombuffer(data, "<i8", n_tok, pos).copy()
        pos += 8 * n_tok
        rows = {}
        for col in spec.columns:
            size = n * col.width * item
            if pos + size > len(data):
                raise HsxError(f"{path}: truncated rows of column {col.name!r} at byte {pos}")
            rows[col.name] = buf[pos:pos + size].view(dtype).view(n, col.width)
            pos += size
        out.append(Record(kind, tokens, rows))
    return out


def discard(spec: CaptureSpec, rid: str) -> None:
    try:
        os.unlink(spec.path(rid))
    except FileNotFoundError:
        pass
