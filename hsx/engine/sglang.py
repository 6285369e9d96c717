"""SGLang engine: an in-process ``sglang.Engine`` fed token ids, its hidden states turned into aligned rows.

The only module that imports ``sglang`` (lazily, in :func:`import_sglang`). Requests go in as token
ids; hsx tokenizes and renders chat templates itself. What SGLang 0.5.23 returns for a finished
request with ``return_hidden_states=True``:

- ``out["output_ids"]``: the completion tokens (a matched stop token included);
- ``out["meta_info"]["hidden_states"]``: nested lists of floats. ``hs[0]`` is the prefill block,
  one row per prompt position that was computed; ``hs[t]`` (t >= 1) is the decode row that
  produced completion token t. ``len(hs) == completion_tokens``;
- ``num_retractions``: a retracted (preempted) request is prefilled again and gets a second
  prefill block in the middle of its list;
- speculative stats ``spec_verify_ct``, ``spec_accept_length``, ``spec_accept_rate``,
  ``spec_num_correct_drafts``, ``spec_correct_drafts_histogram``; per-step accept lengths are not
  exposed, so samples carry ``verify_steps`` and no ``accept_lens``.

Every prompt position must be computed, so hsx starts the engine with the radix cache off (a
cache hit returns only the uncached suffix) and chunked prefill off (only the last chunk would
come back). The rows pass through the alignment core's :class:`~hsx.align.Collector` like the
transformers engine's: ``prefill`` with ``hs[0]``, ``extend`` with ``hs[1:]``, ``finish``.

Which layer: without aux capture the rows are the final-norm output (the input of lm_head) for
Llama/Qwen-style models. Boundaries come from SGLang's EAGLE3 aux capture, which returns the
concatenation of the captured layers (low to high) in place of the final state; its ids are
"input of layer id+1" for most models, i.e. boundary id+1 (see :func:`sglang_capture`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hsx.align import FINAL, Collector, LayerGroup, ModelShape, parse_layers, teacher_forced
from hsx.config import ExtractConfig
from hsx.engine.loader import eagle3_ids_from_config
from hsx.errors import AlignmentError, HsxError, SampleError
from hsx.shards.format import DTYPES

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
# Model types whose draft-config ids are used as-is unless the first id is 1.
FIRST_ID_RULE_MODELS = {"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite"}


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


def sglang_capture(ids: Sequence[int] | None, model_type: str | None, num_layers: int) -> tuple[int, ...]:
    """The boundaries SGLang captures for EAGLE3 layer ids ``ids`` (None: the model's default).

    SGLang captures the input of layer i (boundary i) for i in ``layers_to_capture``; most models
    set it to ``[id + 1 for id in ids]``; GPT-OSS keeps ids as-is when ``max(ids) == L``; the
    DeepSeek-V2 family adds 1 only when the first id is 1.
    """
    if ids is None:
        return (2, num_layers // 2, num_layers - 3)
    ids = tuple(int(i) for i in ids)
    if model_type == "gpt_oss" and max(ids) == num_layers:
        return ids
    if model_type in FIRST_ID_RULE_MODELS and ids[0] != 1:
        return ids
    return tuple(i + 1 for i in ids)


def capture_ids_for(boundaries: Sequence[int], model_type: str | None, num_layers: int) -> list[int]:
    """SGLang layer ids that make it capture exactly ``boundaries`` (low to high), or HsxError."""
    b = tuple(int(x) for x in boundaries)
    if list(b) != sorted(set(b)):
        raise HsxError(f"SGLang concatenates captured layers low to high; boundaries {list(b)} are not strictly increasing")
    for ids in ([x - 1 for x in b], list(b)):
        if all(0 <= i < num_layers for i in ids) and sglang_capture(ids, model_type, num_layers) == b \
                and all(x < num_layers for x in b):
            return ids
    raise HsxError(
        f"SGLang cannot capture boundaries {list(b)} of this {num_layers}-block {model_type} model: no layer id "
        f"list maps to them under its capture rule (ids name blocks 0..{num_layers - 1}; for most models "
        f"boundary = id + 1, so boundaries 1..{num_layers - 1} are reachable)"
    )


@dataclass(frozen=True)
class _Plan:
    """What the engine is started with and what its rows mean."""

    group: LayerGroup
    engine_args: dict
    algorithm: str | None  # speculative algorithm actually running, None without speculation


def check_checkpoints(cfg: ExtractConfig) -> None:
    """Refuse a target or draft checkpoint with missing or unexpected weights before SGLang loads it.

    The target (and a draft language model) through transformers' own loading report on the meta
    device; an EAGLE3 head against its config and the target's, from the file headers. EAGLE
    (``LlamaForCausalLMEagle``) heads are not checked here.
    """
    from transformers import AutoConfig

    from hsx.engine.families import check_checkpoint
    from hsx.engine.heads import check_eagle3_head, head_kind

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


class SGLangRunner:
    """``sglang.Engine`` driven over rendered prompts; same interface as :class:`~hsx.engine.loader.HFRunner`."""

    name = "sglang"

    def __init__(self, cfg: ExtractConfig):
        from transformers import AutoConfig, AutoTokenizer

        self.cfg = cfg
        remote = cfg.trust_remote_code
        check_checkpoints(cfg)  # SGLang skips weights it has no place for and keeps what it did not find
        self.sglang = import_sglang()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=remote)
            self.model_config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=remote)
            draft_config = AutoConfig.from_pretrained(cfg.draft_model, trust_remote_code=remote) if cfg.draft_model else None
        except (OSError, ValueError) as e:
            raise HsxError(f"cannot load the config or tokenizer of {cfg.model!r}"
                           + (f" / draft {cfg.draft_model!r}" if cfg.draft_model else "") + f": {e}") from None
        self.shape = ModelShape.from_config(self.model_config)
        self.context_length = getattr(self.model_config, "max_position_embeddings", None)
        self.plan = self._plan(draft_config)
        self.groups: list[LayerGroup] = [self.plan.group]
        self.store_dtype = DTYPES[cfg.dtype]
        self.stop_token_ids = sorted(self._stop_tokens())
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
        draft_ids = eagle3_ids_from_config(draft_config) if draft_config is not None and algorithm == "EAGLE3" else None
        if draft_ids is not None and cfg.eagle3_layer_ids is not None and list(cfg.eagle3_layer_ids) != draft_ids:
            raise HsxError(f"--eagle3-layer-ids {cfg.eagle3_layer_ids} differ from the draft config's "
                           f"{draft_ids}, which is what SGLang captures under EAGLE3")
        groups = parse_layers(cfg.layers, self.shape, cfg.eagle3_layer_ids if cfg.eagle3_layer_ids is not None else draft_ids)
        if len(groups) != 1:
            raise HsxError(f"--engine sglang returns one hidden-state column per request; --layers {cfg.layers!r} "
                           f"asks for {len(groups)} ({[g.name for g in groups]})")
        group = groups[0]
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

        if group.sources == (FINAL,):
            if algorithm == "EAGLE3":
                raise HsxError("under EAGLE3 SGLang returns the aux concatenation, not the final state: "
                               "use --layers eagle3")
            if model_type in PRE_NORM_MODELS:
                raise HsxError(f"SGLang returns pre-norm states for {model_type} models, not the final-norm output")
        elif algorithm == "EAGLE3":
            captured = sglang_capture(draft_ids, model_type, self.shape.num_layers)
            if tuple(group.sources) != captured:
                raise HsxError(f"--layers {group.name} is boundaries {list(group.sources)}, but SGLang's EAGLE3 "
                               f"captures boundaries {list(captured)} for draft ids {draft_ids}")
            group = _annotate(group, draft_ids, "from the draft config")
        elif algorithm is None:
            ids = capture_ids_for(group.sources, model_type, self.shape.num_layers)
            args.update(enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                        return_aux_hidden_state_layer_ids=ids)
            group = _annotate(group, ids, "return_aux_hidden_state_layer_ids")
        else:
            raise HsxError(f"--spec-algorithm {algorithm} returns the final state; SGLang cannot also capture "
                           f"boundaries {list(group.sources)} (aux capture runs without a draft)")

        if algorithm is not None:
            steps, topk, draft_tokens = cfg.spec_settings()
            args.update(speculative_algorithm=algorithm, speculative_num_steps=steps,
                        speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens)
            if cfg.draft_model:
                args["speculative_draft_model_path"] = cfg.draft_model
        clash = {k: v for k, v in cfg.engine_args.items() if k in args and args[k] != v}
        fixed = sorted(k for k in clash if k in REQUIRED_ARGS)
        if fixed:
            raise HsxError(f"engine_args {fixed} conflict with what hsx needs ({ {k: REQUIRED_ARGS[k] for k in fixed} }): "
                           "full prompt rows, hidden states on, token ids in")
        if clash:
            raise HsxError(f"engine_args {sorted(clash)} conflict with options hsx sets from its own configuration "
                           f"({ {k: args[k] for k in clash} }); set them through the config fields")
        args.update(cfg.engine_args)
        return _Plan(group, args, algorithm)

    def _stop_tokens(self) -> set[int]:
        from transformers import GenerationConfig

        stops = set()
        try:
            gen = GenerationConfig.from_pretrained(self.cfg.model)
        except OSError:
            gen = None
        for source in (gen, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            stops.update([eos] if isinstance(eos, int) else (eos or []))
        return stops

    def describe(self) -> dict:
        args = {k: v for k, v in self.plan.engine_args.items() if k != "model_path"}
        return {"name": "sglang", "version": str(self.sglang.__version__), "torch": torch.__version__,
                "compute_dtype": self.cfg.model_dtype, "device_type": self.cfg.device, "args": args}

    def describe_speculative(self) -> dict | None:
        if self.plan.algorithm is None:
            return None
        steps, topk, draft_tokens = self.cfg.spec_settings()
        return {"algorithm": self.plan.algorithm, "draft_model": self.cfg.draft_model, "num_steps": steps,
                "topk": topk, "num_draft_tokens": draft_tokens, "tree": topk > 1}

    # ---- requests ------------------------------------------------------------------------

    def _sampling(self) -> dict:
        cfg = self.cfg
        params = {"max_new_tokens": 1 if cfg.mode == "prefill" else cfg.max_new_tokens,
                  "temperature": cfg.temperature, "top_p": cfg.top_p, "stop_token_ids": self.stop_token_ids}
        if cfg.temperature > 0:
            params["sampling_seed"] = cfg.seed
        return params

    def _generate(self, prompt_ids: list[list[int]]) -> list[dict]:
        outs = self.engine.generate(input_ids=prompt_ids, sampling_params=self._sampling(), return_hidden_states=True)
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(prompt_ids):
            raise HsxError(f"sglang returned {len(outs)} outputs for {len(prompt_ids)} requests")
        return outs

    def run(self, prompts) -> list:
        """One :class:`AlignedSample` or :class:`SampleError` per prompt, in order.

        A retracted request is run once more on its own batch; retracted again, it is an error.
        """
        ids = [list(p.input_ids) for p in prompts]
        outs = self._generate(ids)
        again = [i for i, o in enumerate(outs) if o["meta_info"].get("num_retractions", 0)]
        if again:
            for i, out in zip(again, self._generate([ids[i] for i in again])):
                outs[i] = out
        return [self._convert(p.sample_id, ids[i], outs[i]) for i, p in enumerate(prompts)]

    def _convert(self, sid: str, prompt_ids: list[int], out: dict):
        """One SGLang output -> AlignedSample, or SampleError naming what was expected and found."""
        meta = out["meta_info"]
        retractions = meta.get("num_retractions", 0)
        if retractions:
            return SampleError(sid, f"retracted (preempted) {retractions} time(s) on a second run too; a retracted "
                                    "request's hidden states hold a second prefill block")
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind not in ("stop", "length"):
            return SampleError(sid, f"sglang finished the request with {finish!r}")
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


def _annotate(group: LayerGroup, ids, where: str) -> LayerGroup:
    """Record SGLang's own ids for the group's boundaries in its ``rule``."""
    if ids is None:
        how = "SGLang's default, inputs of blocks [2, L//2, L-3]"
    else:
        how = "boundary = id" if tuple(ids) == tuple(group.sources) else "boundary = id + 1"
    rule = f"{group.rule}; SGLang capture ids {list(ids) if ids is not None else None} ({where}; {how})"
    return LayerGroup(group.name, group.sources, group.width, group.raw_ids, rule)
