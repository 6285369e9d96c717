"""Per-request hidden-state rows from prefill blocks and speculative verify steps.

Alignment convention: row p is the state after consuming token p, i.e. the state that predicts
token p+1. A generated sample of N tokens (prompt P + completion C) has rows for positions
0..N-2: the last completion token is never fed back, so completion rows == C. A teacher-forced
(prefill) sample has rows for all positions 0..N-1.

A verify step hands over one ``[batch * stride, W]`` tensor per layer group. Request i's stride
holds its accepted path at the front (root token, then accepted drafts), so its rows are
``[i*stride, i*stride + accept_len_i)``. The step's emitted tokens (accepted drafts + the bonus
token) are laid out the same way in a ``[batch, stride]`` tensor and are cut with the same mask,
so tokens and rows cannot drift apart. The last step may overshoot max_new_tokens or a stop
token; ``finish`` trims both to the finished length.

On CUDA the rows are converted to the stored dtype on the device and copied into pinned host
memory without blocking the engine; a sample carries the event recorded after its last copy as
``ready``, and whoever reads its values first calls ``wait()`` (the shard writer does, on its own
thread). On CPU the copies are plain and ``ready`` is None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from hsx.align.layers import LayerGroup
from hsx.errors import AlignmentError


@dataclass
class AlignedSample:
    """One sequence with its rows: ``hidden[name]`` is ``[rows, W]``, row j is position ``first_position + j``."""

    input_ids: torch.Tensor  # [N] int64
    prompt_len: int
    hidden: dict[str, torch.Tensor]
    first_position: int = 0
    accept_lens: torch.Tensor | None = None  # [verify_steps] int16, None without speculation
    finish_reason: str = "length"
    verify_steps: int | None = None  # speculative steps when the engine reports their count but not accept_lens
    ready: object | None = field(default=None, repr=False, compare=False)  # torch.cuda.Event of the host copies
    # a vision-language target's per-sample columns (hsx.shards.format.VISION_FIELDS), None otherwise
    vision: dict | None = field(default=None, compare=False)

    def wait(self) -> None:
        """Block until ``hidden`` holds its values (a no-op unless they are being copied from a GPU)."""
        if self.ready is not None:
            self.ready.synchronize()

    @property
    def num_rows(self) -> int:
        return next(iter(self.hidden.values())).shape[0] if self.hidden else 0


def accepted_mask(accept_lens: torch.Tensor, stride: int) -> torch.Tensor:
    """``[B, stride]`` bool: True on the first accept_len_i slots of each request's stride."""
    slots = torch.arange(stride, device=accept_lens.device)
    return slots[None, :] < accept_lens[:, None]


def accepted_rows(step: torch.Tensor, accept_lens: torch.Tensor, stride: int) -> torch.Tensor:
    """The accepted rows of a ``[B*stride, W]`` verify output, request after request: ``[sum(a), W]``."""
    batch = accept_lens.shape[0]
    if step.shape[0] != batch * stride:
        raise AlignmentError(f"verify step has {step.shape[0]} rows, expected batch {batch} x stride {stride}")
    if bool(((accept_lens < 0) | (accept_lens > stride)).any()):
        raise AlignmentError(f"accept lengths {accept_lens.tolist()} outside 0..{stride}")
    return step.view(batch, stride, -1)[accepted_mask(accept_lens.to(step.device), stride)]


def slice_verify_step(step: torch.Tensor, accept_lens: torch.Tensor, stride: int) -> list[torch.Tensor]:
    """Split a ``[B*stride, W]`` verify output into each request's accepted rows (never one row per step)."""
    return list(accepted_rows(step, accept_lens, stride).split(accept_lens.tolist()))


class _Request:
    __slots__ = ("prompt_ids", "tokens", "rows", "accept_lens")

    def __init__(self, prompt_ids: torch.Tensor, names: Sequence[str]):
        self.prompt_ids = prompt_ids
        self.tokens: list[torch.Tensor] = []
        self.rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.accept_lens: list[int] = []


class Collector:
    """Accumulates rows per request id; ``finish`` returns an :class:`AlignedSample`.

    All hidden tensors are moved to CPU in ``dtype`` once per step per group, then sliced as views.
    ``ready`` is the event recorded after the latest step's device copies (None on CPU); copies
    are ordered on the stream, so it covers every earlier one too.
    """

    def __init__(self, groups: Sequence[LayerGroup], dtype: torch.dtype):
        self.groups = {g.name: g for g in groups}
        self.dtype = dtype
        self._reqs: dict[object, _Request] = {}
        self.ready: object | None = None
        self._copied = False  # a device copy was queued since the last event

    def _check(self, name: str, h: torch.Tensor, where: str) -> torch.Tensor:
        group = self.groups.get(name)
        if group is None:
            raise AlignmentError(f"{where}: engine returned column {name!r}, expected one of {list(self.groups)}")
        if h.dim() != 2 or h.shape[1] != group.width:
            raise AlignmentError(
                f"{where}: column {name!r} has shape {tuple(h.shape)}, expected [rows, {group.width}] "
                f"(sources {list(group.sources)}); a width mismatch is never reshaped"
            )
        return h.detach()

    def _to_host(self, h: torch.Tensor) -> torch.Tensor:
        if h.device.type != "cuda":
            return h.to(device="cpu", dtype=self.dtype)
        out = torch.empty(h.shape, dtype=self.dtype, pin_memory=True)
        out.copy_(h.to(self.dtype), non_blocking=True)  # converted on the device: fewer bytes cross the bus
        self._copied = True
        return out

    def _host(self, name: str, h: torch.Tensor, where: str) -> torch.Tensor:
        return self._to_host(self._check(name, h, where))

    def _mark(self) -> None:
        """Record an event after the copies queued so far (call once per step)."""
        if self._copied:
            self.ready = torch.cuda.Event()
            self.ready.record()
            self._copied = False

    def _check_names(self, hidden: Mapping[str, torch.Tensor], where: str) -> None:
        if set(hidden) != set(self.groups):
            raise AlignmentError(f"{where}: got columns {sorted(hidden)}, expected {sorted(self.groups)}")

    def prefill(self, rid, prompt_ids: torch.Tensor, hidden: Mapping[str, torch.Tensor], first_token: int | None) -> None:
        """Start request ``rid`` with its prompt block: one row per prompt position (P rows)."""
        where = f"request {rid!r} prefill"
        self._check_names(hidden, where)
        prompt_ids = prompt_ids.detach().to("cpu", torch.int64).reshape(-1)
        req = _Request(prompt_ids, list(self.groups))
        for name, h in hidden.items():
            h = self._host(name, h, where)
            if h.shape[0] != prompt_ids.numel():
                raise AlignmentError(
                    f"{where}: {h.shape[0]} prompt rows for a {prompt_ids.numel()}-token prompt "
                    "(a cached or chunked prefill returns only part of the prompt)"
                )
            req.rows[name].append(h)
        self._mark()
        if first_token is not None:
            req.tokens.append(torch.tensor([first_token], dtype=torch.int64))
        self._reqs[rid] = req

    def extend(self, rid, hidden: Mapping[str, torch.Tensor], tokens: torch.Tensor) -> None:
        """Append n decode rows and the n tokens they produced to request ``rid``."""
        req = self._req(rid)
        where = f"request {rid!r} decode"
        self._check_names(hidden, where)
        tokens = tokens.detach().to("cpu", torch.int64).reshape(-1)
        for name, h in hidden.items():
            h = self._host(name, h, where)
            if h.shape[0] != tokens.numel():
                raise AlignmentError(f"{where}: {h.shape[0]} rows of {name!r} for {tokens.numel()} tokens")
            req.rows[name].append(h)
        self._mark()
        req.tokens.append(tokens)

    def step(
        self,
        rids: Sequence,
        hidden: Mapping[str, torch.Tensor],
        tokens: torch.Tensor,
        accept_lens: torch.Tensor,
        stride: int,
    ) -> None:
        """One verify step over the requests ``rids`` (slot i of the batch is ``rids[i]``).

        ``hidden[name]`` is ``[len(rids) * stride, W]``; ``tokens`` is ``[len(rids), stride]`` with
        each request's emitted tokens at the front; ``accept_lens`` is ``[len(rids)]`` (correct
        drafts + 1, or 0 for a slot that emitted nothing this step).
        """
        accept_lens = accept_lens.detach().to("cpu", torch.int64)
        if tokens.shape != (len(rids), stride):
            raise AlignmentError(f"verify step tokens have shape {tuple(tokens.shape)}, expected ({len(rids)}, {stride})")
        self._check_names(hidden, "verify step")
        # Tokens first: their blocking copy would otherwise wait for the hidden copies queued before it.
        tok = slice_verify_step(tokens.detach().to("cpu", torch.int64).reshape(-1, 1), accept_lens, stride)
        split = accept_lens.tolist()
        cut = {}
        for name, h in hidden.items():  # cut on the device, so only accepted rows are copied
            cut[name] = self._to_host(accepted_rows(self._check(name, h, "verify step"), accept_lens, stride)).split(split)
        self._mark()
        for i, rid in enumerate(rids):
            a = int(accept_lens[i])
            if a == 0:
                continue
            req = self._req(rid)
            for name in cut:
                req.rows[name].append(cut[name][i])
            req.tokens.append(tok[i].reshape(-1))
            req.accept_lens.append(a)

    def finish(self, rid, finished_len: int, finish_reason: str, speculative: bool = True) -> AlignedSample:
        """Close request ``rid`` with ``finished_len`` completion tokens; trims any overshoot."""
        req = self._reqs.pop(rid, None)
        if req is None:
            raise AlignmentError(f"request {rid!r} finished but was never started")
        prompt_len = req.prompt_ids.numel()
        completion = torch.cat(req.tokens) if req.tokens else torch.zeros(0, dtype=torch.int64)
        if completion.numel() < finished_len:
            raise AlignmentError(f"request {rid!r}: {completion.numel()} tokens produced, finished length {finished_len}")
        need = prompt_len + finished_len - 1  # generate mode: positions 0..N-2
        if self.ready is not None and any(len(parts) > 1 for parts in req.rows.values()):
            self.ready.synchronize()  # the cat below reads the copied rows
        hidden = {}
        for name, parts in req.rows.items():
            rows = torch.cat(parts) if len(parts) > 1 else parts[0]
            if rows.shape[0] < need:
                raise AlignmentError(
                    f"request {rid!r}: {rows.shape[0]} rows of {name!r}, need {need} for "
                    f"{prompt_len} prompt + {finished_len} completion tokens (rows were dropped)"
                )
            hidden[name] = rows[:need]
        accept = torch.tensor(req.accept_lens, dtype=torch.int16) if speculative else None
        ids = torch.cat([req.prompt_ids, completion[:finished_len]])
        return AlignedSample(ids, prompt_len, hidden, 0, accept, finish_reason, ready=self.ready)

    def _req(self, rid) -> _Request:
        req = self._reqs.get(rid)
        if req is None:
            raise AlignmentError(f"request {rid!r} has rows but no prefill block")
        return req


def teacher_forced(input_ids: torch.Tensor, hidden: Mapping[str, torch.Tensor], groups: Sequence[LayerGroup], dtype: torch.dtype) -> AlignedSample:
    """A prefill-mode sample: one row per position 0..N-1 of ``input_ids``."""
    c = Collector(groups, dtype)
    ids = input_ids.detach().to("cpu", torch.int64).reshape(-1)  # before the row copies: a blocking copy would wait for them
    n = ids.numel()
    out = {}
    for name, h in hidden.items():
        h = c._host(name, h, "teacher-forced sample")
        if h.shape[0] != n:
            raise AlignmentError(f"teacher-forced sample: {h.shape[0]} rows of {name!r} for {n} tokens")
        out[name] = h
    c._mark()
    if set(out) != set(c.groups):
        raise AlignmentError(f"teacher-forced sample: got columns {sorted(out)}, expected {sorted(c.groups)}")
    return AlignedSample(ids, n, out, 0, None, "prefill", ready=c.ready)
