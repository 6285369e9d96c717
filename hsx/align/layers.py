"""Layer groups: which hidden states a column holds, in one engine-independent convention.

Boundaries count the residual stream between blocks of an L-block decoder:
  boundary 0      = output of the embedding (input of block 0)
  boundary b      = output of block b-1, before the final norm (1 <= b <= L)
  ``final``       = output of the final norm, the input of lm_head
On hyper-connection models (``hc_mult`` streams between blocks) a boundary is all the streams,
``hidden_size * hc_mult`` wide, and ``final`` is ``hidden_size`` wide: lm_head reads one stream,
the final norm of the streams' collapse.
transformers' ``output_hidden_states`` tuple has L+1 entries: entry i is boundary i for i < L,
but entry L is ``final`` (post-norm); boundary L is only reachable with a hook on the norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hsx.errors import HsxError

FINAL = "final"
EAGLE3 = "eagle3"


@dataclass(frozen=True)
class LayerGroup:
    """One hidden-state column: the sources concatenated along the width, low to high as given."""

    name: str
    sources: tuple[int | str, ...]  # boundaries (int) or FINAL
    width: int  # total width of one row: unit width * len(sources)
    raw_ids: tuple[int, ...] | None = None  # ids as the user or a draft config gave them
    rule: str = "boundary"  # how raw_ids became sources

    def describe(self) -> dict:
        return {
            "name": self.name,
            "sources": list(self.sources),
            "width": self.width,
            "raw_ids": None if self.raw_ids is None else list(self.raw_ids),
            "rule": self.rule,
        }

    @staticmethod
    def from_description(d: dict) -> "LayerGroup":
        raw = d.get("raw_ids")
        return LayerGroup(
            name=d["name"],
            sources=tuple(d["sources"]),
            width=int(d["width"]),
            raw_ids=None if raw is None else tuple(raw),
            rule=d.get("rule", "boundary"),
        )


@dataclass(frozen=True)
class ModelShape:
    """What alignment needs to know about a model: block count and the width of one state."""

    num_layers: int
    hidden_size: int
    hc_mult: int = 1  # hyper-connection models carry hc_mult parallel residual streams

    @property
    def unit_width(self) -> int:
        """The width of one boundary: all ``hc_mult`` streams of a hyper-connection model."""
        return self.hidden_size * max(1, self.hc_mult)

    def width_of(self, source: int | str) -> int:
        """One source's width: a boundary is ``unit_width``; ``final`` (lm_head's input, after a
        hyper-connection model collapses its streams) is ``hidden_size``."""
        return self.hidden_size if source == FINAL else self.unit_width

    def spans(self, sources) -> list[tuple[int, int]]:
        """``(start, stop)`` of each source's columns in a row of ``sources`` side by side."""
        out, at = [], 0
        for s in sources:
            out.append((at, at + self.width_of(s)))
            at += self.width_of(s)
        return out

    @staticmethod
    def from_config(config) -> "ModelShape":
        """Read a transformers ``PretrainedConfig`` (or anything with the same attributes)."""
        text = getattr(config, "text_config", None) or config
        hc = getattr(text, "hc_mult", None) or 1
        return ModelShape(int(text.num_hidden_layers), int(text.hidden_size), int(hc))


def eagle3_default_boundaries(num_layers: int) -> tuple[int, int, int]:
    """SGLang's default EAGLE3 capture, already in boundary terms: inputs of blocks 2, L//2, L-3."""
    return (2, num_layers // 2, num_layers - 3)


def eagle3_boundaries_from_ids(ids: Sequence[int], num_layers: int) -> tuple[tuple[int, ...], str]:
    """Map a draft config's ``eagle_aux_hidden_state_layer_ids`` to boundaries.

    Draft configs name layers by their output ("output of layer i" = boundary i+1), except when
    the largest id equals L: such lists are already boundaries (SGLang's GPT-OSS rule).
    """
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3:
        raise HsxError(f"EAGLE3 needs 3 aux layer ids, got {list(ids)}")
    if max(ids) == num_layers:
        return ids, "as-is (max id == num_layers: ids are already boundaries)"
    return tuple(i + 1 for i in ids), "+1 (ids name layer outputs)"


def _check_boundary(b: int, shape: ModelShape, what: str) -> None:
    if not 0 <= b <= shape.num_layers:
        raise HsxError(f"{what}: boundary {b} is outside 0..{shape.num_layers} for a {shape.num_layers}-block model")


def parse_layers(
    spec: str | Sequence[str | int],
    shape: ModelShape,
    eagle3_ids: Sequence[int] | None = None,
) -> list[LayerGroup]:
    """Turn ``"final,eagle3,0,4"`` (or a list of the same items) into layer groups.

    Items: ``final``; ``eagle3`` (three boundaries, from ``eagle3_ids`` when given, else SGLang's
    default); an integer boundary ``b`` or ``bN`` -> a column named ``bN``.
    """
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    items = [s for s in items if s]
    if not items:
        raise HsxError("--layers is empty: give at least one of final, eagle3, or a boundary number")
    groups: list[LayerGroup] = []
    unit = shape.unit_width
    for item in items:
        if item == FINAL:
            rule = "final norm output" if shape.hc_mult <= 1 else \
                f"final norm output: the {shape.hc_mult} streams collapsed, hidden_size wide"
            groups.append(LayerGroup(FINAL, (FINAL,), shape.width_of(FINAL), None, rule))
        elif item == EAGLE3:
            if eagle3_ids is None:
                b = eagle3_default_boundaries(shape.num_layers)
                rule = "SGLang default [2, L//2, L-3] (inputs of those blocks)"
                raw = None
            else:
                b, rule = eagle3_boundaries_from_ids(eagle3_ids, shape.num_layers)
                raw = tuple(int(i) for i in eagle3_ids)
            for x in b:
                _check_boundary(x, shape, "eagle3")
            groups.append(LayerGroup(EAGLE3, b, unit * 3, raw, rule))
        else:
            text = item[1:] if item.startswith("b") else item
            if not text.isdigit():
                raise HsxError(f"--layers item {item!r} is not 'final', 'eagle3', or a boundary number")
            b = int(text)
            _check_boundary(b, shape, f"--layers item {item!r}")
            groups.append(LayerGroup(f"b{b}", (b,), unit, (b,), "boundary"))
    names = [g.name for g in groups]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise HsxError(f"--layers names a column twice: {dupes}")
    return groups


def needed_sources(groups: Sequence[LayerGroup]) -> list[int | str]:
    """The distinct boundaries (and FINAL) an engine must capture for these groups, sorted."""
    bs = sorted({s for g in groups for s in g.sources if s != FINAL})
    return [*bs, *([FINAL] if any(FINAL in g.sources for g in groups) else [])]
