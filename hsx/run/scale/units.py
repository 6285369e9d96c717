"""Cut a dataset into units: fixed windows of ``unit_size`` source rows, a row whose id appeared earlier
joining that first row's unit (so one worker sees every row of an id and decides duplicates as the
single process does). The plan is deterministic, and it holds no Python object per row: the ids are
read as Arrow, coded as integers, and each unit's rows and ids are kept packed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hsx.config import ExtractConfig
from hsx.errors import HsxError
from hsx.shards.packed import PackedInts, PackedStrings

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass
class Unit:
    index: int
    rows: PackedInts  # source indices, increasing (a list of int, held packed)
    ids: PackedStrings  # the sample id each row will get (as the renderer names it)


def plan_units(cfg: ExtractConfig, id_values, num_rows: int) -> list[Unit]:
    """Deterministic units: ``[k * size, (k + 1) * size)``, a repeated id joining its first row's unit.
    ``id_values`` is None (every row named ``split:index``), a list of the rows' id values, or the id
    column as a pyarrow array (see :func:`dataset_units`); a null id names its row ``split:index`` and
    joins nothing. Each unit's rows and ids are held packed: the driver keeps every unit for the whole
    run, and no step holds a Python object per row."""
    size = cfg.rows_per_unit
    starts = range(0, num_rows, size)
    if id_values is None:  # every row its own id: each unit its window
        return [Unit(k, PackedInts(range(a, min(a + size, num_rows))),
                     PackedStrings(f"{cfg.split}:{i}" for i in range(a, min(a + size, num_rows))))
                for k, a in enumerate(starts)]
    ids = _arrow_ids(id_values)
    if ids is None:  # a Python list, or a column arrow does not name as str() does
        ids = _chunked(_python_ids(_values(id_values[a:a + _BLOCK])) for a in range(0, num_rows, _BLOCK))
    return _plan(cfg, ids.slice(0, num_rows), num_rows)


_BLOCK = 1 << 16  # rows whose id values are read (or made into Python objects, for the fallback) at once


def _chunked(arrays):
    import pyarrow as pa

    return pa.chunked_array(list(arrays), type=pa.large_binary())


def _values(values) -> list:
    return values.to_pylist() if hasattr(values, "to_pylist") else values


def _python_ids(values) -> "pa.Array":
    """Row ids as the renderer names them (``str(value)``), UTF-8 bytes, null for a null value."""
    import pyarrow as pa

    return pa.array([None if v is None else str(v).encode("utf-8", "surrogatepass") for v in values],
                    type=pa.large_binary())


def _arrow_ids(values) -> "pa.ChunkedArray | None":
    """An arrow id column as the renderer's ids (UTF-8 bytes, nulls kept), for the types whose arrow text
    is ``str()`` of the Python value (strings, integers); None for any other (a bool casts to "true")."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, pa.Array):
        values = pa.chunked_array([values])
    if not isinstance(values, pa.ChunkedArray) or not _named_by_arrow(values.type):
        return None
    if pa.types.is_integer(values.type):
        values = pc.cast(values, pa.string())
    return pc.cast(values, pa.large_binary())


def _named_by_arrow(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _plan(cfg: ExtractConfig, ids, n: int) -> list[Unit]:
    """:func:`plan_units` over ``ids`` (a large_binary chunked array, null for an unnamed row), vectorised:
    one int code per row, each code's first row, each row's unit, one stable sort by unit."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    size = cfg.rows_per_unit
    count = -(-n // size)
    codes = pc.index_in(ids, value_set=pc.unique(ids).drop_null())  # null where the id is null
    named = np.asarray(codes.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    codes = codes.fill_null(-1).to_numpy()
    unit = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64) // size  # a null id keeps its own window
    where = np.flatnonzero(named)
    first = np.zeros(0, np.int64)
    if len(where):  # every code occurs: np.unique's k-th first position is code k's
        first = where[np.unique(codes[where], return_index=True)[1]]
    unit[where] = first[codes[where]] // size
    del codes, first, where
    order = np.argsort(unit, kind="stable")  # rows by unit, increasing within each
    bounds = np.concatenate([[0], np.cumsum(np.bincount(unit, minlength=count))]).tolist()
    del unit
    unnamed = np.flatnonzero(~named)
    if len(unnamed):  # these rows are named split:index, appended after the ids and gathered from there
        spare = pc.binary_join_element_wise(f"{cfg.split}:", pc.cast(pa.array(unnamed), pa.string()), "")
        ids = pa.chunked_array(ids.chunks + [pc.cast(spare, pa.large_binary())], type=pa.large_binary())
        source = np.arange(n, dtype=np.int64)
        source[unnamed] = n + np.arange(len(unnamed))
        gather = source[order]
        del source
    else:
        gather = order
    del named, unnamed
    ordered = pc.take(ids, pa.array(gather)).combine_chunks()
    del gather
    return [Unit(k, PackedInts(order[a:b]), PackedStrings.from_arrow(ordered.slice(a, b - a)))
            for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def dataset_units(cfg: ExtractConfig, rows) -> list[Unit]:
    """:func:`plan_units` over a dataset's rows, naming them by ``cfg.id_field``. A string or integer id
    column is read as arrow (``Dataset.select_columns`` keeps a ``select``/``shuffle`` order); any other is
    read as the renderer reads it, ``_BLOCK`` values at a time."""
    if cfg.id_field is not None and cfg.id_field not in rows.column_names:
        raise HsxError(f"--id-field {cfg.id_field!r} is not a column of the dataset; its columns are {rows.column_names}")
    if not cfg.id_field:
        return plan_units(cfg, None, len(rows))
    return _plan(cfg, _dataset_ids(rows, cfg.id_field), len(rows))


def _dataset_ids(rows, field: str):
    from datasets import ClassLabel, Value

    n = len(rows)
    plain = rows.format["type"] is None and isinstance(rows.features[field], (Value, ClassLabel))
    if plain and _named_by_arrow(rows.data.schema.field(field).type):
        table = rows.select_columns([field]).with_format("arrow")
        return _chunked(chunk for a in range(0, n, _BLOCK)
                        for chunk in _arrow_ids(table[a:a + _BLOCK][field]).chunks)
    column = rows[field]
    return _chunked(_python_ids(column[a:a + _BLOCK]) for a in range(0, n, _BLOCK))
