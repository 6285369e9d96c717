"""SGLang engine: an in-process ``sglang.Engine`` fed token ids, its hidden states turned into aligned rows.

The only module that imports ``sglang`` (lazily, in :func:`import_sglang`); the SGLang internals
hsx's capture wraps live in :mod:`hsx.engine.sglang.capture`. Requests go in as token ids; hsx
tokenizes and renders chat templates itself. Every prompt position must be computed, so hsx starts
the engine with the radix cache off (a cache hit computes only the uncached suffix) and chunked
prefill off (only the last chunk would come back).

Two ways the rows come out (``--sglang-capture``):

- ``tensors`` (default): hsx's capture in SGLang's scheduler process cuts each request's prefill
  block and accepted verify rows, together with the step's tokens, and appends them as raw bytes to
  one file per request (see :mod:`hsx.engine.sglang.capture`). Several columns come from the same
  forward (``hidden``: the final state, or the aux concatenation under aux capture / EAGLE3;
  ``last``: the post-norm final state next to the aux states), and each step's accept length is its
  record's length. The captured tokens must equal SGLang's ``output_ids``, the accept lengths its
  ``spec_verify_ct`` and ``spec_correct_drafts_histogram``; ``meta_info["hidden_states"]`` must be empty.
- ``lists``: SGLang's ``return_hidden_states`` output, nested float lists in
  ``out["meta_info"]["hidden_states"]``: ``hs[0]`` the prefill block, ``hs[t]`` (t >= 1) the decode
  row that produced completion token t, ``len(hs) == completion_tokens``; one column per request,
  per-request totals only (samples carry ``verify_steps``, no ``accept_lens``).

Either way, ``num_retractions > 0`` means a retracted (preempted) request, prefilled twice: it is run
once more on its own. The rows pass through the alignment core's :class:`~hsx.align.Collector`
like the transformers engine's.

Which layer: SGLang's aux capture ids are "input of layer id+1" for most models, i.e. boundary
id+1 (see :func:`hsx.heads.layer_ids.sglang_boundaries`). An EAGLE3 draft whose ``hsx`` marker says its
ids follow vLLM's rule (boundary = id) is handed to SGLang as a copy whose config names SGLang's ids for
the same boundaries (:func:`hsx.heads.layer_ids.resolve_head_layers`).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hsx.align import EAGLE3, FINAL, Collector, LayerGroup, ModelShape, parse_layers, teacher_forced
from hsx.config import ExtractConfig
from hsx.heads.layer_ids import RULE_KEY, SGLANG_READING, HeadLayers, head_marker, resolve_head_layers, sglang_boundaries, sglang_ids_for
from hsx.engine.sglang.capture import ERROR, PREFILL, CaptureSpec, Column, check_version, discard, read_records
from hsx.engine.contract import Runner, in_batches, load_configs, stop_token_ids
from hsx.errors import AlignmentError, HsxError, SampleError
from hsx.shards.format import DTYPE_NAMES, dtype_of

log = logging.getLogger("hsx")
MIN_VERSION = "0.5.23"  # spec-V2 verify keeps every request's accepted rows (dropped/misattributed before)
SPEC_ALGORITHMS = ("EAGLE", "EAGLE3")
REFUSED_ALGORITHMS = {
    "NGRAM": "its verify trees do not move rejected rows to the back, so a request's rows include rejected drafts",
    "STANDALONE": "its verify path returns an empty hidden-state list",
    "DFLASH": "its verify path returns an empty hidden-state list",
    "DSPARK": "its verify path returns no per-token hidden states hsx has checked",
}
# Settings hsx needs for full prompt rows; engine_args may not change them.
REQUIRED_ARGS = {"disable_radix_cache": True, "chunked_prefill_size": -1, "enable_return_hidden_states": True,
                 "skip_tokenizer_init": True}
# Model types whose returned rows are pre-norm states rather than the final-norm output.
PRE_NORM_MODELS = {"deepseek_v4", "mimo_v2", "step3p5", "inkling"}


def import_sglang():
    """``import sglang``, refusing a missing install or a release older than :data:`MIN_VERSION`."""
    try:
        import sglang
    except ImportError as e:
        raise HsxError(f"--engine sglang needs SGLang >= {MIN_VERSION}: pip install 'hsx[sglang]' ({e})") from None
    from packaging.version import InvalidVersion, Version

    found = getattr(sglang, "__version__", None)
    try:
        ok = found is not None and Version(str(found)) >= Version(MIN_VERSION)
    except InvalidVersion:
        ok = False
    if not ok:
        raise HsxError(
            f"SGLang {found} is installed; hsx needs >= {MIN_VERSION}, the first release whose speculative "
            f"verify returns every accepted hidden row for the right request: pip install 'hsx[sglang]'"
        )
    return sglang


@dataclass(frozen=True)
class _Plan:
    """What the engine is started with and what its rows mean."""

    groups: list[LayerGroup]
    engine_args: dict
    algorithm: str | None  # speculative algorithm actually running, None without speculation
    capture: CaptureSpec | None = None  # None: SGLang's float lists (--sglang-capture lists)
    head: HeadLayers | None = None  # the EAGLE3 draft's ids resolved, recorded with the run

    @property
    def group(self) -> LayerGroup:
        return self.groups[0]


def check_checkpoints(cfg: ExtractConfig) -> None:
    """Refuse a target or draft checkpoint with missing or unexpected weights before SGLang loads it.

    The target (and a draft language model) through transformers' own loading report on the meta
    device; an EAGLE3 head against its config and the target's, from the file headers. EAGLE
    (``LlamaForCausalLMEagle``) heads are not checked here.
    """
    from transformers import AutoConfig

    from hsx.engine.families import check_checkpoint
    from hsx.heads.load import check_eagle3_head, head_kind

    remote = cfg.trust_remote_code
    try:
        check_checkpoint(cfg.model, "target model", remote)
        if cfg.draft_model:
            kind = head_kind(cfg.draft_model)
            if kind == "eagle3":
                check_eagle3_head(cfg.draft_model, AutoConfig.from_pretrained(cfg.model, trust_remote_code=remote))
            elif kind is None:
                check_checkpoint(cfg.draft_model, "draft model", remote)
    except (OSError, ValueError) as e:
        raise HsxError(f"cannot read the checkpoint of {cfg.model!r}"
                       + (f" / draft {cfg.draft_model!r}" if cfg.draft_model else "") + f": {e}") from None


class SGLangRunner(Runner):
    """``sglang.Engine`` driven over rendered prompts (:class:`hsx.engine.contract.Runner`)."""

    name = "sglang"
    id_reading = SGLANG_READING

    @classmethod
    def check_config(cls, cfg: ExtractConfig) -> None:
        if cfg.prefill_chunk is not None:
            raise HsxError(f"--prefill-chunk {cfg.prefill_chunk} applies to the transformers engine (--engine hf); SGLang "
                           "splits long prompts itself: --engine-arg chunked_prefill_size=N")

    def __init__(self, cfg: ExtractConfig):
        self.check_config(cfg)  # also when built directly, not through the registry
        self.cfg = cfg
        check_checkpoints(cfg)  # SGLang skips weights it has no place for and keeps what it did not find
        self.sglang = import_sglang()
        if cfg.sglang_capture == "tensors":
            check_version(self.sglang.__version__)
        self.tokenizer, self.model_config, draft_config = load_configs(cfg)
        self.shape = ModelShape.from_config(self.model_config)
        self.context_length = getattr(self.model_config, "max_position_embeddings", None)
        self._requests = 0
        self.plan = self._plan(draft_config)
        self.groups: list[LayerGroup] = list(self.plan.groups)
        self.store_dtype = dtype_of(cfg.dtype)
        self.stop_token_ids = list(stop_token_ids(cfg.model, self.tokenizer))
        try:
            self.engine = self.sglang.Engine(**self.plan.engine_args)
        except Exception as e:  # SGLang reports bad arguments as many exception types
            raise HsxError(f"sglang.Engine failed to start with {self.plan.engine_args}: {type(e).__name__}: {e}") from None

    # ---- configuration -------------------------------------------------------------------

    def _plan(self, draft_config) -> _Plan:
        cfg = self.cfg
        algorithm = (cfg.spec_algorithm or "").upper() or None
        if algorithm in REFUSED_ALGORITHMS:
            raise HsxError(f"--spec-algorithm {algorithm} is refused with --engine sglang: {REFUSED_ALGORITHMS[algorithm]}")
        if algorithm is not None and algorithm not in SPEC_ALGORITHMS:
            raise HsxError(f"--spec-algorithm {algorithm!r}: hsx supports {' or '.join(SPEC_ALGORITHMS)} with --engine sglang")
        if algorithm is None and cfg.speculative:
            raise HsxError("--draft-model/--spec-* with --engine sglang need --spec-algorithm EAGLE or EAGLE3")
        model_type = getattr(self.model_config, "model_type", None)
        head = self._head_layers(algorithm, draft_config, model_type)
        head_ids = None if head is None or head.head_ids is None else list(head.head_ids)
        if head_ids is not None and cfg.eagle3_layer_ids is not None and list(cfg.eagle3_layer_ids) != head_ids:
            raise HsxError(f"--eagle3-layer-ids {cfg.eagle3_layer_ids} differ from the draft config's "
                           f"{head_ids}, which is what SGLang captures under EAGLE3")
        # the ids SGLang will read: the head's, or those of the copy hsx hands it (a head whose ids follow vLLM's rule)
        draft_ids = None if head is None or head.ids is None else list(head.ids)
        groups = parse_layers(cfg.layers, self.shape, cfg.eagle3_layer_ids if cfg.eagle3_layer_ids is not None else draft_ids)
        if head is not None and head.boundaries is not None:
            groups = [LayerGroup(g.name, head.boundaries, g.width, head.head_ids, head.note()) if g.name == EAGLE3 else g
                      for g in groups]
        args = {"model_path": cfg.model, "random_seed": cfg.seed, **REQUIRED_ARGS}
        if cfg.trust_remote_code:
            args["trust_remote_code"] = True
        if cfg.model_dtype != "auto":
            args["dtype"] = cfg.model_dtype
        if cfg.device != "auto":
            device, _, index = cfg.device.partition(":")
            args["device"] = device
            if index:
                args["base_gpu_id"] = int(index)
        if any(FINAL in g.sources for g in groups) and model_type in PRE_NORM_MODELS:
            raise HsxError(f"SGLang returns pre-norm states for {model_type} models, not the final-norm output")

        capture = None
        if cfg.sglang_capture == "lists":
            groups = [self._list_group(groups, algorithm, draft_ids, model_type, args)]
        else:
            groups, columns, widths = self._columns(groups, algorithm, draft_ids, model_type, args)
            capture = CaptureSpec(_capture_dir(), f"hsx{uuid.uuid4().hex[:12]}-", DTYPE_NAMES[dtype_of(cfg.dtype)], columns, widths,
                                  tree=algorithm is not None and cfg.spec_settings()[1] > 1)
            atexit.register(shutil.rmtree, capture.dir, True)

        if algorithm is not None:
            steps, topk, draft_tokens = cfg.spec_settings()
            args.update(speculative_algorithm=algorithm, speculative_num_steps=steps,
                        speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens)
            if cfg.draft_model:
                args["speculative_draft_model_path"] = self._draft_path(head)
        clash = {k: v for k, v in cfg.engine_args.items() if k in args and args[k] != v}
        fixed = sorted(k for k in clash if k in REQUIRED_ARGS)
        if fixed:
            raise HsxError(f"engine_args {fixed} conflict with what hsx needs ({ {k: REQUIRED_ARGS[k] for k in fixed} }): "
                           "full prompt rows, hidden states on, token ids in")
        if clash:
            raise HsxError(f"engine_args {sorted(clash)} conflict with options hsx sets from its own configuration "
                           f"({ {k: args[k] for k in clash} }); set them through the config fields")
        args.update(cfg.engine_args)
        if capture is not None:
            args["forward_hooks"] = list(args.get("forward_hooks") or []) + [capture.hook()]
        return _Plan(groups, args, algorithm, capture, head)

    def _head_layers(self, algorithm, draft_config, model_type) -> HeadLayers | None:
        """The draft's aux layer ids resolved for SGLang (:func:`resolve_head_layers`); a head converted for vLLM
        under EAGLE is refused (SGLang's EAGLE runs the ``LlamaForCausalLMEagle`` original)."""
        if draft_config is None or algorithm not in ("EAGLE", "EAGLE3"):
            return None
        if algorithm == "EAGLE":
            marker = head_marker(draft_config)
            if marker and marker[RULE_KEY] == "vllm":
                raise HsxError(f"--draft-model {self.cfg.draft_model}: its hsx marker says it is a head in vLLM's format "
                               "(written by hsx export vllm-head); SGLang's EAGLE loads the SGLang-format original "
                               "(LlamaForCausalLMEagle) it was converted from")
            return None
        try:
            return resolve_head_layers(draft_config, self.id_reading, model_type, self.shape.num_layers)
        except HsxError as e:
            raise HsxError(f"--draft-model {self.cfg.draft_model}: {e}") from None

    def _draft_path(self, head: HeadLayers | None) -> str:
        """The draft directory SGLang is given: the head itself, or, when its ids follow vLLM's rule, a copy whose
        config names SGLang's ids for the same boundaries (its weight files linked), removed at exit."""
        if head is None or not head.needs_rewrite:
            return self.cfg.draft_model
        from hsx.heads.vllm_head import write_ids_copy

        where = tempfile.mkdtemp(prefix="hsx-head-")
        atexit.register(shutil.rmtree, where, True)
        copy = write_ids_copy(self.cfg.draft_model, Path(where) / "head", list(head.ids), "sglang", head.boundaries)
        log.warning("--draft-model %s names aux layer ids %s by vLLM's rule (boundaries %s); SGLang reads ids by its "
                    "own rule, so hsx hands it a copy whose config names ids %s for the same boundaries: %s (weights "
                    "linked, removed at exit)", self.cfg.draft_model, list(head.head_ids), list(head.boundaries),
                    list(head.ids), copy)
        self._draft_copy = str(copy)
        return str(copy)

    def _list_group(self, groups, algorithm, draft_ids, model_type, args) -> LayerGroup:
        """SGLang's float lists: one column per request, and which one depends on the algorithm."""
        if len(groups) != 1:
            raise HsxError(f"--sglang-capture lists returns one hidden-state column per request; --layers "
                           f"{self.cfg.layers!r} asks for {len(groups)} ({[g.name for g in groups]}): use "
                           "--sglang-capture tensors")
        group = groups[0]
        if group.sources == (FINAL,):
            if algorithm == "EAGLE3":
                raise HsxError("under EAGLE3 SGLang's lists hold the aux concatenation, not the final state: "
                               "use --layers eagle3, or --sglang-capture tensors for both")
            return group
        if algorithm == "EAGLE3":
            captured = sglang_boundaries(draft_ids, model_type, self.shape.num_layers)
            if tuple(group.sources) != captured:
                raise HsxError(f"--layers {group.name} is boundaries {list(group.sources)}, but SGLang's EAGLE3 "
                               f"captures boundaries {list(captured)} for draft ids {draft_ids}")
            return _annotate(group, draft_ids, captured, "from the draft config")
        if algorithm is None:
            ids = sglang_ids_for(group.sources, model_type, self.shape.num_layers)
            args.update(enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                        return_aux_hidden_state_layer_ids=ids)
            return _annotate(group, ids, group.sources, "return_aux_hidden_state_layer_ids")
        raise HsxError(f"--spec-algorithm {algorithm} returns the final state; SGLang cannot also capture "
                       f"boundaries {list(group.sources)} (aux capture runs without a draft)")

    def _columns(self, groups, algorithm, draft_ids, model_type, args):
        """Groups, the capture's columns and its source widths: where each column sits in SGLang's
        ``hidden`` / ``last`` outputs of the same forward.

        With aux capture (plain decoding with boundary columns, or EAGLE3) ``hidden`` is the
        concatenation of the captured boundaries and ``last`` the post-norm final state; otherwise
        ``hidden`` is the final state.
        """
        unit, num_layers = self.shape.unit_width, self.shape.num_layers
        bounds = tuple(sorted({s for g in groups for s in g.sources if s != FINAL}))
        if algorithm == "EAGLE3":
            captured = sglang_boundaries(draft_ids, model_type, num_layers)
            missing = [b for b in bounds if b not in captured]
            if missing:
                raise HsxError(f"under EAGLE3 SGLang captures boundaries {list(captured)} (draft ids {draft_ids}); "
                               f"--layers {self.cfg.layers!r} also asks for {missing}")
            ids, where = draft_ids, "from the draft config"
        elif algorithm == "EAGLE" and bounds:
            raise HsxError(f"under EAGLE SGLang's target computes only the final state; boundaries {list(bounds)} need "
                           "--spec-algorithm EAGLE3 (its draft's aux layers) or no speculation (aux capture)")
        elif bounds:
            captured = bounds
            ids, where = sglang_ids_for(bounds, model_type, num_layers), "return_aux_hidden_state_layer_ids"
            args.update(enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                        return_aux_hidden_state_layer_ids=ids)
        else:
            captured = ()
        aux = algorithm == "EAGLE3" or bool(bounds)
        where_is = {b: ("hidden", i * unit) for i, b in enumerate(captured)}
        where_is[FINAL] = ("last", 0) if aux else ("hidden", 0)
        out_groups, columns = [], []
        for g in groups:
            pieces: list[tuple[str, int, int]] = []
            for s in g.sources:
                src, start = where_is[s]
                width = self.shape.width_of(s)  # final: one stream on a hyper-connection model
                if pieces and pieces[-1][0] == src and pieces[-1][2] == start:
                    pieces[-1] = (src, pieces[-1][1], start + width)  # contiguous: one slice
                else:
                    pieces.append((src, start, start + width))
            columns.append(Column(g.name, tuple(pieces)))
            out_groups.append(_annotate(g, ids, captured, where) if g.sources != (FINAL,) else g)
        final = self.shape.width_of(FINAL)
        widths = {"hidden": unit * len(captured) if aux else final}
        if any(p[0] == "last" for c in columns for p in c.pieces):
            widths["last"] = final
            graphs = self.cfg.device != "cpu" and not self.cfg.engine_args.get("disable_cuda_graph", False)
            if algorithm == "EAGLE3" and graphs:
                raise HsxError(
                    "--layers final under --spec-algorithm EAGLE3: SGLang keeps the final state next to the aux "
                    "states only when told so before its CUDA graphs are captured, and SGLang loads hsx's capture "
                    "after that, so graph-replayed verify steps would come without it. Add --engine-arg "
                    "disable_cuda_graph=true, or take final (and the aux layers) from a run without --spec-algorithm")
        return out_groups, tuple(columns), widths

    def describe(self) -> dict:
        args = {k: v for k, v in self.plan.engine_args.items() if k not in ("model_path", "forward_hooks")}
        capture = self.plan.capture
        return {"name": "sglang", "version": str(self.sglang.__version__), "torch": torch.__version__,
                "compute_dtype": self.cfg.model_dtype, "device_type": self.cfg.device, "args": args,
                "capture": "lists" if capture is None else {
                    "kind": "tensors", "columns": {c.name: [list(p) for p in c.pieces] for c in capture.columns}}}

    def describe_speculative(self) -> dict | None:
        if self.plan.algorithm is None:
            return None
        steps, topk, draft_tokens = self.cfg.spec_settings()
        out = {"algorithm": self.plan.algorithm, "draft_model": self.cfg.draft_model, "num_steps": steps,
               "topk": topk, "num_draft_tokens": draft_tokens, "tree": topk > 1}
        if self.plan.head is not None:
            out["aux_layers"] = self.plan.head.describe()
            if self.plan.head.needs_rewrite:  # SGLang read the copy (engine_ids), not the head's own config
                out["aux_layers"]["copy_read"] = getattr(self, "_draft_copy", None)
        return out

    # ---- requests ------------------------------------------------------------------------

    def _sampling(self) -> dict:
        cfg = self.cfg
        params = {"max_new_tokens": 1 if cfg.mode == "prefill" else cfg.max_new_tokens,
                  "temperature": cfg.temperature, "top_p": cfg.top_p, "stop_token_ids": self.stop_token_ids}
        if cfg.temperature > 0:
            params["sampling_seed"] = cfg.seed
        return params

    def _generate(self, prompt_ids: list[list[int]], rids: list[str] | None = None) -> list[dict]:
        kwargs = {"rid": rids} if rids is not None else {}
        outs = self.engine.generate(input_ids=prompt_ids, sampling_params=self._sampling(), return_hidden_states=True,
                                    **kwargs)
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(prompt_ids):
            raise HsxError(f"sglang returned {len(outs)} outputs for {len(prompt_ids)} requests")
        return outs

    def _new_rids(self, n: int) -> list[str]:
        first, self._requests = self._requests, self._requests + n
        return [f"{self.plan.capture.prefix}{first + i}" for i in range(n)]

    def stream(self, prompts):
        """``(prompt, sample)`` for a window of prompts: ``batch_size`` at a time, in window order."""
        return in_batches(prompts, self.cfg.batch_size, self.run)

    def run(self, prompts) -> list:
        """One :class:`AlignedSample` or :class:`SampleError` per prompt, in order.

        A retracted request is run once more on its own batch; retracted again, it is an error.
        """
        ids = [list(p.input_ids) for p in prompts]
        capture = self.plan.capture
        rids = self._new_rids(len(ids)) if capture is not None else None
        outs = self._generate(ids, rids)
        again = [i for i, o in enumerate(outs) if o["meta_info"].get("num_retractions", 0)]
        if again:
            fresh = self._new_rids(len(again)) if capture is not None else None
            for k, (i, out) in enumerate(zip(again, self._generate([ids[i] for i in again], fresh))):
                outs[i] = out
                if capture is not None:
                    discard(capture, rids[i])
                    rids[i] = fresh[k]
        if capture is None:
            return [self._convert(p.sample_id, ids[i], outs[i]) for i, p in enumerate(prompts)]
        samples = []
        for i, p in enumerate(prompts):
            try:
                samples.append(self._from_capture(p.sample_id, rids[i], ids[i], outs[i]))
            finally:
                discard(capture, rids[i])
        return samples

    def _finish_kind(self, sid: str, meta: dict):
        """The finish reason, or a SampleError for a retracted or aborted request."""
        retractions = meta.get("num_retractions", 0)
        if retractions:
            return SampleError(sid, f"retracted (preempted) {retractions} time(s) on a second run too; a retracted "
                                    "request's hidden states hold a second prefill block")
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind not in ("stop", "length"):
            return SampleError(sid, f"sglang finished the request with {finish!r}")
        return kind

    def _from_capture(self, sid: str, rid: str, prompt_ids: list[int], out: dict):
        """One request's capture file + SGLang's output -> AlignedSample, or SampleError naming what differs."""
        meta = out["meta_info"]
        kind = self._finish_kind(sid, meta)
        if isinstance(kind, SampleError):
            return kind
        if meta.get("hidden_states"):
            raise HsxError(f"sample {sid!r}: SGLang returned hidden states as float lists although hsx's capture is "
                           "selected: the capture is not installed in SGLang's scheduler (forward_hooks)")
        records = read_records(self.plan.capture, rid)
        errors = [r.message for r in records if r.kind == ERROR]
        if errors:
            return SampleError(sid, f"capture in SGLang's scheduler: {errors[0]}")
        prefills = [j for j, r in enumerate(records) if r.kind == PREFILL]
        if prefills != [0]:
            return SampleError(sid, f"capture holds prefill blocks at records {prefills} of {len(records)}, expected "
                                    "exactly one, first (a retracted request is prefilled again)")
        prefill, steps = records[0], records[1:]
        tokens = np.concatenate([r.tokens for r in records])
        output = np.asarray(out["output_ids"], dtype=np.int64)
        completion = int(meta["completion_tokens"])
        if output.size != completion:
            return SampleError(sid, f"{output.size} output ids for completion_tokens {completion}")
        last = steps[-1].tokens.size if steps else prefill.tokens.size
        if tokens.size < completion or tokens.size - last >= max(completion, 1) \
                or not np.array_equal(tokens[:completion], output):
            return SampleError(sid, f"captured tokens {tokens[:completion + 4].tolist()} ({len(steps)} steps) do not "
                                    f"match SGLang's output_ids {output[:completion + 4].tolist()} ({completion} tokens): "
                                    "a step's rows are missing or belong to another request")
        accept = torch.tensor([r.tokens.size for r in steps], dtype=torch.int16)
        if self.plan.algorithm is not None and self.cfg.mode == "generate":
            problem = _check_spec_totals(accept, meta)
            if problem:
                return SampleError(sid, problem)
        prompt = torch.tensor(prompt_ids, dtype=torch.int64)
        names = [g.name for g in self.groups]
        try:
            if self.cfg.mode == "prefill":
                return teacher_forced(prompt, prefill.rows, self.groups, self.store_dtype)
            collector = Collector(self.groups, self.store_dtype)
            collector.prefill(sid, prompt, prefill.rows, int(prefill.tokens[0]))
            if steps:
                rows = {n: torch.cat([r.rows[n] for r in steps]) for n in names}
                collector.extend(sid, rows, torch.from_numpy(np.concatenate([r.tokens for r in steps])))
            sample = collector.finish(sid, completion, kind, speculative=False)
        except AlignmentError as e:
            return SampleError(sid, str(e))
        if self.plan.algorithm is not None:
            sample.accept_lens = accept
        return sample

    def _convert(self, sid: str, prompt_ids: list[int], out: dict):
        """One SGLang output -> AlignedSample, or SampleError naming what was expected and found."""
        meta = out["meta_info"]
        kind = self._finish_kind(sid, meta)
        if isinstance(kind, SampleError):
            return kind
        hs = meta.get("hidden_states")
        if not isinstance(hs, list) or not hs:
            raise HsxError(f"sample {sid!r}: sglang returned no hidden states (meta_info keys {sorted(meta)})")
        completion = int(meta["completion_tokens"])
        tokens = list(out["output_ids"])
        if len(tokens) != completion:
            return SampleError(sid, f"{len(tokens)} output ids for completion_tokens {completion}")
        if len(hs) != completion:
            return SampleError(sid, f"{len(hs)} hidden-state entries for completion_tokens {completion} "
                                    "(expected the prefill block plus one row per further token: rows were dropped)")
        name, width = self.plan.group.name, self.plan.group.width
        prefill = _block(hs[0], width, sid, "prefill block")  # [rows, W]
        decode = _block(hs[1:], width, sid, "decode rows") if completion > 1 else np.zeros((0, width), np.float32)
        prompt = torch.tensor(prompt_ids, dtype=torch.int64)
        try:
            if self.cfg.mode == "prefill":
                return teacher_forced(prompt, {name: torch.from_numpy(prefill)}, self.groups, self.store_dtype)
            collector = Collector(self.groups, self.store_dtype)
            collector.prefill(sid, prompt, {name: torch.from_numpy(prefill)}, tokens[0])
            if completion > 1:
                collector.extend(sid, {name: torch.from_numpy(decode)}, torch.tensor(tokens[1:], dtype=torch.int64))
            sample = collector.finish(sid, completion, kind, speculative=False)
        except AlignmentError as e:
            return SampleError(sid, str(e))
        if self.plan.algorithm is not None:
            sample.verify_steps = int(meta.get("spec_verify_ct", 0))
        return sample


def _check_spec_totals(accept: torch.Tensor, meta: dict) -> str | None:
    """Per-step accept lengths against SGLang's own per-request totals; a message when they differ."""
    if "spec_verify_ct" not in meta or "spec_correct_drafts_histogram" not in meta:
        return f"SGLang reported no spec_verify_ct / spec_correct_drafts_histogram (meta_info keys {sorted(meta)})"
    steps = int(meta["spec_verify_ct"])
    correct = accept.long() - 1
    hist = torch.bincount(correct, minlength=1).tolist() if accept.numel() else []
    theirs = list(meta["spec_correct_drafts_histogram"] or [])
    trim = lambda h: h[:max((i + 1 for i, v in enumerate(h) if v), default=0)]
    if steps != accept.numel() or trim(hist) != trim(theirs):
        return (f"captured {accept.numel()} verify steps with accept lengths {accept.tolist()}, but SGLang counted "
                f"spec_verify_ct {steps} and correct-draft histogram {theirs}: a step's rows are missing")
    if "spec_num_correct_drafts" in meta and int(meta["spec_num_correct_drafts"]) != int(correct.sum()):
        return (f"captured accept lengths {accept.tolist()} hold {int(correct.sum())} correct drafts, SGLang counted "
                f"{meta['spec_num_correct_drafts']}")
    return None


def _capture_dir() -> str:
    """A fresh directory for the capture files: in shared memory (/dev/shm) where there is one."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="hsx-capture-", dir=base)


def _block(rows, width: int, sid: str, what: str) -> np.ndarray:
    """Nested float lists -> one ``[n, width]`` float32 array; a width mismatch stops the run (never reshaped)."""
    try:
        block = np.asarray(rows, dtype=np.float32)
    except ValueError:
        widths = sorted({len(r) for r in rows if isinstance(r, list)})
        raise AlignmentError(f"sample {sid!r}: {what} rows have widths {widths}, declared width {width}") from None
    if block.ndim != 2 or block.shape[1] != width:
        raise AlignmentError(f"sample {sid!r}: {what} has shape {block.shape}, declared width {width} "
                             "(hidden x K for aux capture, x hc_mult for hyper-connections); never reshaped")
    return block


def _annotate(group: LayerGroup, ids, captured, where: str) -> LayerGroup:
    """Record SGLang's own ids for the captured boundaries in the group's ``rule``."""
    if ids is None:
        how = "SGLang's default, inputs of blocks [2, L//2, L-3]"
    else:
        how = "boundary = id" if tuple(ids) == tuple(captured) else "boundary = id + 1"
    rule = f"{group.rule}; SGLang capture ids {list(ids) if ids is not None else None} ({where}; {how})"
    return LayerGroup(group.name, group.sources, group.width, group.raw_ids, rule)
