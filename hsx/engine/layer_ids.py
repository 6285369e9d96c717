"""EAGLE3 layer ids: what a draft config names, and which boundaries each engine's rule makes of them.

A head's config lists ``eagle_aux_hidden_state_layer_ids``; what a list means depends on who reads it.
hsx stores and compares boundaries (docs/FORMAT.md, "Layer boundaries": boundary 0 the embedding
output, boundary b the output of block b-1), and converts every engine's ids here, in one place, so
that no engine module needs another's rule.

SGLang captures the input of layer i (boundary i) for each i of its ``layers_to_capture``. Most of its
models set that list to ``[id + 1 for id in ids]``; GPT-OSS keeps the ids as they are when
``max(ids) == L``; the DeepSeek-V2 family adds 1 only when the first id is 1. Without ids a model takes
``(2, L // 2, L - 3)``.
"""

from __future__ import annotations

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
