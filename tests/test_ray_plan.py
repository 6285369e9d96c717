"""The Ray driver's unit plan over an id column: the vectorised planner against the row-by-row one it
replaced (same units, rows, ids), over every kind of id column, and its memory at 200K rows."""

from __future__ import annotations

import gc
import tracemalloc

import datasets
import pyarrow as pa
import pytest

from hsx.config import ExtractConfig
from hsx.errors import HsxError
from hsx.run.scale.units import dataset_units, plan_units
from hsx.shards.packed import PackedInts, PackedStrings


def reference(cfg: ExtractConfig, id_values: list, num_rows: int) -> list[tuple[int, list[int], list[str]]]:
    """The plan row by row: window ``i // size``, a repeated (non-null) id joining its first row's unit."""
    size = cfg.rows_per_unit
    starts = range(0, num_rows, size)
    rows: list[list[int]] = [[] for _ in starts]
    ids: list[list[str]] = [[] for _ in starts]
    owner: dict[str, int] = {}
    for i in range(num_rows):
        value = id_values[i]
        sid = f"{cfg.split}:{i}" if value is None else str(value)
        k = i // size if value is None else owner.setdefault(sid, i // size)
        rows[k].append(i)
        ids[k].append(sid)
    return [(k, r, d) for k, (r, d) in enumerate(zip(rows, ids))]


def plain(units) -> list[tuple[int, list[int], list[str]]]:
    assert all(isinstance(u.rows, PackedInts) and isinstance(u.ids, PackedStrings) for u in units)
    return [(u.index, list(u.rows), list(u.ids)) for u in units]


def cfg_for(size: int) -> ExtractConfig:
    return ExtractConfig(model="m", dataset="d", output="o", batch_size=1, unit_size=size, id_field="id")


N = 40
SPREAD = [f"s{(i * 7) % 13}" for i in range(N)]  # each id again in later units
DATASETS = {
    "strings": datasets.Dataset.from_dict({"id": SPREAD}),
    "unicode": datasets.Dataset.from_dict({"id": ["é", "日本", "", "a\tb", "é", "", "x" * 300, "日本"] * 5}),
    "large_strings": datasets.Dataset.from_dict(
        {"id": SPREAD}, features=datasets.Features({"id": datasets.Value("large_string")})),
    "ints": datasets.Dataset.from_dict({"id": [(i * 5) % 11 - 4 + (2**62 if i % 9 == 0 else 0) for i in range(N)]}),
    "uint8": datasets.Dataset.from_dict(
        {"id": [(i * 3) % 17 for i in range(N)]}, features=datasets.Features({"id": datasets.Value("uint8")})),
    "strings_nulls": datasets.Dataset.from_dict({"id": [None if i % 4 == 1 else s for i, s in enumerate(SPREAD)]}),
    "ints_nulls": datasets.Dataset.from_dict({"id": [None if i % 5 == 0 else i % 6 for i in range(N)]}),
    "all_null": datasets.Dataset.from_dict(
        {"id": [None] * 10}, features=datasets.Features({"id": datasets.Value("string")})),
    "bools": datasets.Dataset.from_dict({"id": [None if i % 7 == 3 else i % 3 == 0 for i in range(N)]}),
    "floats": datasets.Dataset.from_dict({"id": [None if i % 6 == 5 else [1.0, 2.5, float("nan"), -0.0][i % 4]
                                                 for i in range(N)]}),
    "nested": datasets.Dataset.from_dict({"id": [[i % 3, 1] if i % 5 else None for i in range(N)]}),
    "with_text": datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(N)], "id": SPREAD}),
}
DATASETS["selected"] = DATASETS["with_text"].select([i for i in reversed(range(N)) if i % 3])  # indices mapping
DATASETS["shuffled"] = DATASETS["strings_nulls"].shuffle(seed=3)
DATASETS["shuffled_ints"] = DATASETS["ints_nulls"].shuffle(seed=5)
DATASETS["shuffled_bools"] = DATASETS["bools"].shuffle(seed=7)
DATASETS["numpy_format"] = DATASETS["ints"].with_format("numpy")


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_plan_matches_the_row_by_row_plan(name, size):
    rows = DATASETS[name]
    cfg = cfg_for(size)
    values = list(rows["id"])
    want = reference(cfg, values, len(rows))
    assert plain(dataset_units(cfg, rows)) == want
    if rows.format["type"] is None:
        assert plain(plan_units(cfg, [v for v in values], len(rows))) == want  # a Python list, as before
        column = rows.select_columns(["id"]).with_format("arrow")[:]["id"]  # or the arrow column itself
        assert plain(plan_units(cfg, column, len(rows))) == want


def test_plan_edges():
    cfg = cfg_for(4)
    assert plan_units(cfg, [], 0) == [] == dataset_units(cfg, DATASETS["strings"].select([]))
    # a unit whose every row joined an earlier unit stays, empty
    units = plan_units(cfg, ["a", "b", "c", "d", "a", "b", "c", "d", "e"], 9)
    assert plain(units) == [(0, [0, 1, 2, 3, 4, 5, 6, 7], list("abcdabcd")), (1, [], []), (2, [8], ["e"])]
    assert plain(plan_units(cfg, pa.array([True, None, True]), 3)) == [(0, [0, 1, 2], ["True", "train:1", "True"])]
    with pytest.raises(HsxError, match="--id-field 'idx' is not a column of the dataset"):
        dataset_units(ExtractConfig(model="m", dataset="d", output="o", id_field="idx"), DATASETS["strings"])


def test_plan_of_200k_rows_holds_no_python_object_per_row():
    n = 200_000
    rows = datasets.Dataset.from_dict({"id": [f"doc-{(i * 7919) % 150_000:08d}" for i in range(n)]})
    cfg = ExtractConfig(model="m", dataset="d", output="o", batch_size=4, unit_size=128, id_field="id")
    gc.collect()
    tracemalloc.start()
    try:
        units = dataset_units(cfg, rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(units) == 1563 and sum(len(u.rows) for u in units) == n
    # Measured: ~9 MB peak, of which ~5 MB is the packed plan kept (2.4 MB of id bytes, int32 ends and
    # rows) and the rest numpy working arrays of a few bytes a row. The row-by-row planner (a list of
    # the 200K ids, a dict of them and a list per unit) peaked at ~36 MB. Arrow's own buffers are not
    # traced here, and are freed when planning ends.
    assert peak < 16e6, f"planning 200K rows peaked at {peak / 1e6:.1f} MB of Python/numpy memory"


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()])
def test_packed_strings_from_arrow(kind):
    import pickle

    values = ["ab", "", "日本", "x" * 70, "", "é"]
    array = pa.array([v.encode() if kind in (pa.binary(), pa.large_binary()) else v for v in values], type=kind)
    for a, b in [(0, 6), (1, 4), (2, 2), (5, 6)]:
        packed = PackedStrings.from_arrow(array.slice(a, b - a))
        assert packed == values[a:b] and packed == PackedStrings(values[a:b])
        assert pickle.loads(pickle.dumps(packed)) == values[a:b]
    assert PackedStrings.from_arrow(pa.array(["", ""], type=kind)) == ["", ""]
    with pytest.raises(ValueError, match="nulls"):
        PackedStrings.from_arrow(pa.array(["a", None], type=kind))
    with pytest.raises(TypeError):
        PackedStrings.from_arrow(pa.array([1, 2]))
