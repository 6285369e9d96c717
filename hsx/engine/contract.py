"""The runner contract: what every engine hands the run layer, and the helpers engines share.

An engine is a folder under ``hsx/engine/`` whose runner class subclasses :class:`Runner` and is
named in :mod:`hsx.engine.registry`. The run layer (``hsx.run``: the core stream, the pipeline,
the online feed, the Ray worker, the dry-run estimate) builds one with
:func:`hsx.engine.registry.build_engine` and uses only what is listed here.

Class attributes, read before any weight loads:

- ``name``: the engine's registry name, recorded in the metadata (``engine.name``).
- ``id_reading``: how the engine reads EAGLE3 layer ids it is given
  (:class:`hsx.heads.layer_ids.IdReading`): SGLang's rule (boundary = id + 1), vLLM's
  (boundary = id), and whether a head's ids are rewritten for it.
- ``check_config(cfg)``: the engine's own refusals of a config, raised as :class:`HsxError`
  before anything loads (the preflight calls it).

Set by the constructor (``Runner(cfg)``, which loads the model):

- ``tokenizer``: the target's tokenizer (the renderer turns rows into ids with it).
- ``context_length``: the longest sequence the model takes, or ``None`` when it states none.
- ``groups``: the columns the run stores (:class:`hsx.align.LayerGroup`, in order).
- ``model_config``: the target's transformers config (hashed into the metadata).
- ``shape``: :class:`hsx.align.ModelShape` of the target.
- ``vision`` (optional): ``(VisionSpec, image processor)`` of a vision-language target
  (:mod:`hsx.data.images`), which the renderer expands images with; such a runner also has
  ``describe_vision() -> dict``, the metadata's ``vision`` record, and hands back samples whose
  ``vision`` holds the shard's image columns.

Methods, called by the run layer:

- ``describe() -> dict``: the metadata's ``engine`` record (name, version, compute dtype, ...).
- ``describe_speculative() -> dict | None``: the metadata's ``speculative`` record.
- ``stream(prompts)``: for a window of rendered prompts, ``(prompt, AlignedSample | SampleError)``
  pairs as each finishes, every prompt exactly once, in any order. A per-sample problem is a
  :class:`SampleError` in the pair; an :class:`HsxError` raised stops the run.
- ``watch_tokens(callback)`` (optional): the progress bar's feed of tokens prefilled and generated
  as forwards finish (the pipeline calls it once, before the first window).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Iterator, Sequence

from hsx.config import ExtractConfig
from hsx.heads.layer_ids import SGLANG_READING, IdReading


class Runner(abc.ABC):
    """One engine driven over rendered prompts (the contract above)."""

    name: ClassVar[str]
    id_reading: ClassVar[IdReading] = SGLANG_READING

    tokenizer: Any
    context_length: int | None
    groups: list
    model_config: Any
    shape: Any

    @classmethod
    def check_config(cls, cfg: ExtractConfig) -> None:
        """Refuse what this engine cannot run, before anything loads (nothing by default)."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """The metadata's ``engine`` record."""

    @abc.abstractmethod
    def describe_speculative(self) -> dict | None:
        """The metadata's ``speculative`` record, or ``None`` without speculative decoding."""

    @abc.abstractmethod
    def stream(self, prompts: Sequence) -> Iterator[tuple]:
        """``(prompt, AlignedSample | SampleError)`` for each prompt of a window, as each finishes."""

    def watch_tokens(self, callback: Callable[..., None]) -> None:
        """Have ``callback(queued=, prompt=, generated=, budget=)`` told of tokens as forwards finish:
        prompt tokens a window brings (``queued``) and its completion budget (``budget``, generate
        mode; a request that stops early gives the unused part back as a negative ``budget``),
        prompt tokens prefilled (``prompt``) and tokens generated (``generated``). An engine that
        cannot see its forwards ignores it (the default): progress then moves per finished sample."""


def stop_token_ids(model_path: str, tokenizer, generation_config=None) -> tuple[int, ...]:
    """The ids that end a completion: the eos ids of the model's generation config and of its tokenizer.

    ``generation_config`` is the loaded model's own; without it, the one saved beside the model (if any).
    """
    if generation_config is None:
        from transformers import GenerationConfig

        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            generation_config = None
    stops: set[int] = set()
    for source in (generation_config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        stops.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(stops))


def load_configs(cfg: ExtractConfig) -> tuple:
    """For an engine that loads the weights itself: the target's tokenizer and config, and the draft's
    config (or ``None``), refused as one error naming both models when any cannot be read."""
    from transformers import AutoConfig, AutoTokenizer

    from hsx.errors import HsxError

    remote = cfg.trust_remote_code
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=remote)
        model_config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=remote)
        draft_config = AutoConfig.from_pretrained(cfg.draft_model, trust_remote_code=remote) if cfg.draft_model else None
    except (OSError, ValueError) as e:
        raise HsxError(f"cannot load the config or tokenizer of {cfg.model!r}"
                       + (f" / draft {cfg.draft_model!r}" if cfg.draft_model else "") + f": {e}") from None
    if getattr(model_config, "vision_config", None) is not None:
        raise HsxError(f"{cfg.model!r} is a vision-language model ({model_config.model_type}); the {cfg.engine} engine "
                       "does not run vision-language targets in hsx: use --engine hf")
    return tokenizer, model_config, draft_config


def in_batches(prompts: Sequence, size: int, run: Callable[[Sequence], list]) -> Iterator[tuple]:
    """``(prompt, sample)`` for a window handed to ``run`` ``size`` prompts at a time, in window order
    (a server engine's scheduler batches each group's requests itself)."""
    for i in range(0, len(prompts), size):
        batch = prompts[i : i + size]
        yield from zip(batch, run(batch))
