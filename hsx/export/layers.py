"""Where a boundary's states sit in a set of shards: which column, which slice of its width."""

from __future__ import annotations

from dataclasses import dataclass

from hsx.errors import HsxError


@dataclass(frozen=True)
class BoundarySlice:
    boundary: int | str  # a boundary, or "final"
    column: str
    start: int  # first value of the boundary within the column's row
    stop: int


def find_boundary(metadata: dict, boundary: int, where: str) -> BoundarySlice:
    """The first column holding ``boundary`` (a single-boundary ``bN`` column before a concatenation)."""
    groups = sorted(metadata.get("layers", []), key=lambda g: len(g["sources"]))
    for g in groups:
        sources = list(g["sources"])
        if boundary in sources:
            unit = int(g["width"]) // len(sources)
            k = sources.index(boundary)
            return BoundarySlice(boundary, g["name"], k * unit, (k + 1) * unit)
    held = sorted({s for g in groups for s in g["sources"] if isinstance(s, int)})
    raise HsxError(f"{where}: no column holds boundary {boundary}; the shards hold boundaries {held} "
                   f"(columns {[g['name'] for g in metadata.get('layers', [])]}). Re-extract with --layers ...,{boundary}")


def num_layers_of(metadata: dict, where: str) -> int:
    n = int((metadata.get("model") or {}).get("num_layers") or 0)
    if not n:
        raise HsxError(f"{where}: metadata model.num_layers is missing; cannot tell which boundary is the last block's output")
    return n


def require_every_position(metadata: dict, where: str, consumer: str) -> None:
    keep = metadata.get("keep", "all")
    if keep != "all":
        raise HsxError(f"{where}: {consumer} needs a row for every position; these shards keep only {keep!r} "
                       "positions (extract with --keep all)")
