"""EAGLE3 layer ids: what a draft config names, and which boundaries each engine's rule makes of them.

A head's config lists ``eagle_aux_hidden_state_layer_ids``; what a list means depends on who reads it.
hsx stores and compares boundaries (docs/FORMAT.md, "Layer boundaries": boundary 0 the embedding
output, boundary b the output of block b-1), and converts every engine's ids here, in one place, so
that no engine module needs another's rule.

SGLang captures the input of layer i (boundary i) for each i of its ``layers_to_capture``. Most of its
models set that list to ``[id + 1 for id in ids]``; GPT-OSS keeps the ids as they are when
``max(ids) == L``; the DeepSeek-V2 family adds 1 only when the first id is 1. Without ids a model takes
``(2, L // 2, L - 3)``. vLLM reads id i as the input of layer i: boundary i.

So one file names different boundaries on different engines. A head's config may say which rule its
ids follow (the ``hsx`` marker, below); :func:`resolve_head_layers` gives the boundaries and the ids a
given engine must read, and every engine resolves a head's ids through it (docs/EAGLE3.md, "Which rule
a head's ids follow").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hsx.errors import HsxError

# Model types whose draft-config ids are used as-is unless the first id is 1 (SGLang's rule).
FIRST_ID_RULE_MODELS = {"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite"}


def eagle3_ids_from_config(config) -> list[int] | None:
    """``eagle_aux_hidden_state_layer_ids`` from a draft config (top level or its ``eagle_config``)."""
    for holder in (getattr(config, "eagle_config", None), config):
        if isinstance(holder, dict):
            ids = holder.get("eagle_aux_hidden_state_layer_ids")
        else:
            ids = getattr(holder, "eagle_aux_hidden_state_layer_ids", None)
        if ids:
            return [int(i) for i in ids]
    return None


def sglang_boundaries(ids: Sequence[int] | None, model_type: str | None, num_layers: int) -> tuple[int, ...]:
    """The boundaries SGLang captures for EAGLE3 layer ids ``ids`` (None: the model's default)."""
    if ids is None:
        return (2, num_layers // 2, num_layers - 3)
    ids = tuple(int(i) for i in ids)
    if model_type == "gpt_oss" and max(ids) == num_layers:
        return ids
    if model_type in FIRST_ID_RULE_MODELS and ids[0] != 1:
        return ids
    return tuple(i + 1 for i in ids)


def sglang_ids_for(boundaries: Sequence[int], model_type: str | None, num_layers: int) -> list[int]:
    """SGLang layer ids that make it capture exactly ``boundaries`` (low to high), or HsxError."""
    b = tuple(int(x) for x in boundaries)
    if list(b) != sorted(set(b)):
        raise HsxError(f"SGLang concatenates captured layers low to high; boundaries {list(b)} are not strictly increasing")
    for ids in ([x - 1 for x in b], list(b)):
        if all(0 <= i < num_layers for i in ids) and sglang_boundaries(ids, model_type, num_layers) == b \
                and all(x < num_layers for x in b):
            return ids
    raise HsxError(
        f"SGLang cannot capture boundaries {list(b)} of this {num_layers}-block {model_type} model: no layer id "
        f"list maps to them under its capture rule (ids name blocks 0..{num_layers - 1}; for most models "
        f"boundary = id + 1, so boundaries 1..{num_layers - 1} are reachable)"
    )


# ---- which rule a head's ids follow -------------------------------------------------------------
#
# A head's config.json may say which rule its ids follow, and what boundaries they name:
#
#     "hsx": {"aux_layer_ids_rule": "sglang" | "vllm", "aux_boundaries": [2, 4, 6]}
#
# ``aux_layer_ids_rule`` is required in the marker; ``aux_boundaries`` is optional and, when given,
# must be what the rule makes of the ids (a check against hand edits). Heads hsx writes carry both
# (scripts/train_eagle3_demo.py: "sglang"; ``hsx export vllm-head``: "vllm"). A head without the
# marker is read by each engine's own rule, as before the marker existed, and the rule applied is
# recorded with the run (docs/EAGLE3.md, "Which rule a head's ids follow").

MARKER = "hsx"
RULE_KEY = "aux_layer_ids_rule"
BOUNDARIES_KEY = "aux_boundaries"
RULES = ("sglang", "vllm")


@dataclass(frozen=True)
class IdReading:
    """How one engine reads the EAGLE3 layer ids it is given; each runner states its own
    (:class:`hsx.engine.contract.Runner`'s ``id_reading``).

    ``rule``: the rule the engine applies to ids (and to a head without the marker). ``rewrites``:
    whether the ids it must find in a head's config are the head's boundaries put back by its own
    rule (SGLang and vLLM read the config as they load it); ``False`` for an engine that is fed the
    boundaries the head's own rule names (hsx's transformers engine), which takes the ids as they are.
    """

    engine: str
    rule: str
    rewrites: bool = True


# SGLang's reading of ids (the transformers engine runs SGLang's heads by their own rule: no rewrite)
SGLANG_READING = IdReading("sglang", "sglang")
VLLM_READING = IdReading("vllm", "vllm")
HF_READING = IdReading("hf", "sglang", rewrites=False)
CONVERT_FOR_VLLM = "hsx export vllm-head"


def _get(holder, key):
    if isinstance(holder, dict):
        return holder.get(key)
    return getattr(holder, key, None)


def head_marker(config) -> dict | None:
    """The ``hsx`` marker of a draft config (dict or transformers config), checked; None without one."""
    marker = _get(config, MARKER)
    if marker is None:
        return None
    if not isinstance(marker, dict) or marker.get(RULE_KEY) not in RULES:
        raise HsxError(f"the draft config's {MARKER!r} entry {marker!r} is not a layer-id marker: expected "
                       f'{{"{RULE_KEY}": "sglang" or "vllm", "{BOUNDARIES_KEY}": [...]}} (docs/EAGLE3.md)')
    bounds = marker.get(BOUNDARIES_KEY)
    if bounds is not None and (not isinstance(bounds, list) or not all(isinstance(b, int) and not isinstance(b, bool)
                                                                       for b in bounds)):
        raise HsxError(f"the draft config's {MARKER}.{BOUNDARIES_KEY} {bounds!r} is not a list of boundaries")
    return marker


def _head_ids(config) -> list[int] | None:
    """The ids a draft config names; both places (top level, ``eagle_config``) naming different lists is refused
    (vLLM reads the top level first, SGLang and hsx ``eagle_config`` first)."""
    top = _get(config, "eagle_aux_hidden_state_layer_ids")
    nested = _get(_get(config, "eagle_config") or {}, "eagle_aux_hidden_state_layer_ids")
    if top and nested and [int(i) for i in top] != [int(i) for i in nested]:
        raise HsxError(f"the draft config names eagle_aux_hidden_state_layer_ids {list(top)} at its top level and "
                       f"{list(nested)} in eagle_config; engines differ in which they read: keep one")
    ids = nested or top
    return [int(i) for i in ids] if ids else None


def boundaries_by_rule(ids: Sequence[int], rule: str, model_type: str | None, num_layers: int) -> tuple[int, ...]:
    """The boundaries ``ids`` name under ``rule``: vLLM's (boundary = id) or SGLang's (:func:`sglang_boundaries`)."""
    if rule == "vllm":
        return tuple(int(i) for i in ids)
    if rule == "sglang":
        return sglang_boundaries(ids, model_type, num_layers)
    raise HsxError(f"unknown layer-id rule {rule!r}; expected one of {', '.join(RULES)}")


def ids_by_rule(boundaries: Sequence[int], rule: str, model_type: str | None, num_layers: int) -> list[int]:
    """The ids that name ``boundaries`` under ``rule``, or HsxError when the rule cannot reach them."""
    b = [int(x) for x in boundaries]
    if rule == "vllm":
        bad = [x for x in b if not 0 <= x <= num_layers]
        if bad:
            raise HsxError(f"vLLM's layer ids name boundaries 0..{num_layers}; {bad} are outside")
        return b
    if rule == "sglang":
        return sglang_ids_for(b, model_type, num_layers)
    raise HsxError(f"unknown layer-id rule {rule!r}; expected one of {', '.join(RULES)}")


@dataclass(frozen=True)
class HeadLayers:
    """What a draft config's aux layer ids mean, and what one engine must be given to read them so.

    ``rule`` is the rule the head's ids follow: its marker's, or (``marked`` False) the rule of the
    engine that reads it. ``boundaries`` are the hsx boundaries the head was built on (None: the config
    names no ids, the engine's default applies). ``ids`` are the ids the engine must find in the config
    it loads to capture ``boundaries``: for SGLang and vLLM their own rule applied backwards; for the
    transformers engine, which hsx feeds the boundaries itself, the head's ids as they are.
    """

    engine: str
    rule: str
    marked: bool
    head_ids: tuple[int, ...] | None
    boundaries: tuple[int, ...] | None
    ids: tuple[int, ...] | None

    @property
    def needs_rewrite(self) -> bool:
        """The engine reads the config's ids by another rule than the head's: it would capture other boundaries."""
        return self.ids != self.head_ids

    @property
    def source(self) -> str:
        return "the head's hsx marker" if self.marked else f"no hsx marker: {self.engine}'s own rule"

    def describe(self) -> dict:
        """What a run records (``describe_speculative()["aux_layers"]``)."""
        return {"aux_layer_ids_rule": self.rule, "rule_from": "marker" if self.marked else "engine default",
                "head_ids": None if self.head_ids is None else list(self.head_ids),
                "boundaries": None if self.boundaries is None else list(self.boundaries),
                "engine_ids": None if self.ids is None else list(self.ids)}

    def note(self) -> str:
        """One line for a column's ``rule``."""
        if self.head_ids is None:
            return f"draft config names no aux layer ids ({self.source})"
        how = "boundary = id" if self.rule == "vllm" else "SGLang's rule, boundary = id + 1 for most models"
        return (f"draft config ids {list(self.head_ids)} read by the {self.rule} rule ({how}; {self.source}) "
                f"= boundaries {list(self.boundaries)}")


def resolve_head_layers(draft_config, reading: IdReading, model_type: str | None, num_layers: int, *,
                        unmarked_rule: str | None = None) -> HeadLayers:
    """The boundaries a draft config's aux layer ids name, and the ids the engine ``reading`` describes must be given.

    The rule is the config's ``hsx`` marker's, else ``unmarked_rule``, else the engine's own
    (``reading.rule``). A marker whose ``aux_boundaries`` disagree with its ids under its rule, or a
    boundary outside ``0..num_layers``, is refused.
    """
    engine = reading.engine
    marker = head_marker(draft_config)
    rule = marker[RULE_KEY] if marker else (unmarked_rule or reading.rule)
    ids = _head_ids(draft_config)
    if ids is None:
        if marker and marker.get(BOUNDARIES_KEY) is not None:
            raise HsxError(f"the draft config's {MARKER}.{BOUNDARIES_KEY} {marker[BOUNDARIES_KEY]} has no "
                           "eagle_aux_hidden_state_layer_ids beside it: engines read the ids, not the marker")
        return HeadLayers(engine, rule, marker is not None, None, None, None)
    bounds = boundaries_by_rule(ids, rule, model_type, num_layers)
    recorded = marker.get(BOUNDARIES_KEY) if marker else None
    if recorded is not None and list(recorded) != list(bounds):
        raise HsxError(f"the draft config's ids {ids} name boundaries {list(bounds)} by the {rule} rule its hsx marker "
                       f"states, but the marker records aux_boundaries {list(recorded)}: the config was edited "
                       "by hand; fix the ids or the marker")
    bad = [b for b in bounds if not 0 <= b <= num_layers]
    if bad:
        raise HsxError(f"the draft config's ids {ids} name boundaries {list(bounds)} by the {rule} rule; {bad} are "
                       f"outside 0..{num_layers} for a {num_layers}-block target")
    if reading.rewrites:
        engine_ids = tuple(ids_by_rule(bounds, reading.rule, model_type, num_layers))
    else:
        engine_ids = tuple(ids)
    return HeadLayers(engine, rule, marker is not None, tuple(ids), tuple(bounds), engine_ids)


def eagle3_ids_as_boundaries(ids: Sequence[int], rule: str, num_layers: int) -> tuple[tuple[int, ...], str]:
    """The ``eagle3`` column's boundaries for layer ids given without a head (``--eagle3-layer-ids``), by the
    ``rule`` of the engine that captures them: vLLM's boundary = id; SGLang's hsx's generic rule
    (:func:`hsx.align.layers.eagle3_boundaries_from_ids`: + 1, or as they are when the largest is L)."""
    from hsx.align.layers import eagle3_boundaries_from_ids

    ids = tuple(int(i) for i in ids)
    if rule == "vllm":
        if len(ids) != 3 or not all(0 <= i <= num_layers for i in ids):
            raise HsxError(f"EAGLE3 layer ids {list(ids)}: vLLM needs 3 ids in 0..{num_layers}")
        return ids, "vLLM: boundary = id (input of layer id)"
    return eagle3_boundaries_from_ids(ids, num_layers)
