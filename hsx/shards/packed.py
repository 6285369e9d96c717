"""The manifest's per-sample lists, held compactly: tens of bytes a sample in memory, not over a hundred.

A shard entry lists every sample id and source index it holds; read back as Python lists of ``str``
and ``int`` that is over 100 bytes a sample. :class:`PackedStrings` holds a list of strings as one
UTF-8 buffer and the end offset of each, :class:`PackedInts` a list of integers as one numpy array;
both read as the lists they replace (``len``, indexing, iteration, ``==`` with a list). :class:`IdSet`
is the set of sample ids a resumed run skips, one sorted array of fixed-width bytes; :func:`repeats`
finds the ids that an earlier list holds too. Lone surrogates pass through the UTF-8 encoding, so
any Python string packs and reads back. Ids whose fixed width would not be compact (a few very long
ids among short ones) or that end in a NUL byte (which numpy's bytes arrays drop) fall back to
Python sets.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np

_LONG = 64  # bytes: an id list this wide is packed to a fixed width only if that costs < 4x its bytes


class PackedStrings(Sequence):
    """An immutable list of strings in one buffer; equal to a list holding the same strings."""

    __slots__ = ("_data", "_ends")

    def __init__(self, values: Iterable[str] = ()):
        encoded = [v.encode("utf-8", "surrogatepass") for v in values]
        self._data = b"".join(encoded)
        self._ends = _smallest(np.cumsum([len(b) for b in encoded], dtype=np.int64))

    @classmethod
    def _of(cls, data: bytes, ends: np.ndarray) -> "PackedStrings":
        self = cls.__new__(cls)
        self._data, self._ends = data, ends
        return self

    @classmethod
    def from_arrow(cls, array) -> "PackedStrings":
        """The strings of a pyarrow string or binary array (plain or large, no nulls), read from its
        buffers: no Python string per value. Binary values are taken as the UTF-8 bytes of the strings."""
        import pyarrow as pa

        if array.null_count:
            raise ValueError("PackedStrings.from_arrow: the array holds nulls")
        wide = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
        if not (wide or pa.types.is_string(array.type) or pa.types.is_binary(array.type)):
            raise TypeError(f"PackedStrings.from_arrow: expected a string or binary array, got {array.type}")
        n = len(array)
        if not n:
            return cls()
        _, offsets, data = array.buffers()
        offsets = np.frombuffer(offsets, dtype=np.int64 if wide else np.int32)[array.offset:array.offset + n + 1]
        start = int(offsets[0])
        data = data[start:int(offsets[-1])].to_pybytes() if data is not None else b""
        return cls._of(data, _smallest(offsets[1:].astype(np.int64) - start))

    def __reduce__(self):
        return PackedStrings._of, (self._data, self._ends)

    def __len__(self) -> int:
        return len(self._ends)

    def _bytes(self, k: int) -> bytes:
        return self._data[int(self._ends[k - 1]) if k else 0:int(self._ends[k])]

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        return self._bytes(range(len(self))[k]).decode("utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        data, start = self._data, 0
        for end in self._ends.tolist():
            yield data[start:end].decode("utf-8", "surrogatepass")
            start = end

    def encoded(self) -> list[bytes]:
        """The strings as UTF-8 bytes."""
        data, start, out = self._data, 0, []
        for end in self._ends.tolist():
            out.append(data[start:end])
            start = end
        return out

    def widest(self) -> int:
        """Bytes of the longest string (0 for an empty list)."""
        return int(np.diff(self._ends, prepend=0).max()) if len(self) else 0

    def nul_ended(self) -> bool:
        """Whether a string ends in a NUL byte (which a fixed-width numpy bytes array would drop)."""
        if not len(self._data):
            return False
        ends = self._ends[np.diff(self._ends, prepend=0) > 0].astype(np.int64)
        return bool((np.frombuffer(self._data, np.uint8)[ends - 1] == 0).any())

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedStrings):
            return self._data == other._data and np.array_equal(self._ends, other._ends)
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))


class PackedInts(Sequence):
    """An immutable list of integers as one numpy array (``.array``); equal to a list of the same integers."""

    __slots__ = ("array",)

    def __init__(self, values: Iterable[int] = ()):
        self.array = _smallest(np.asarray(list(values) if not isinstance(values, np.ndarray) else values,
                                          dtype=np.int64))

    @classmethod
    def _of(cls, array: np.ndarray) -> "PackedInts":
        self = cls.__new__(cls)
        self.array = array
        return self

    def __reduce__(self):
        return PackedInts._of, (self.array,)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.array[k].tolist()
        return int(self.array[k])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedInts):
            return np.array_equal(self.array, other.array)
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and self.array.tolist() == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self.array.tolist())


def _smallest(a: np.ndarray) -> np.ndarray:
    """``a`` as int32 when every value fits (half the bytes), else int64."""
    if len(a) and (a.min() < -(2**31) or a.max() >= 2**31):
        return a.astype(np.int64)
    return a.astype(np.int32)


def stacked(lists: Sequence[PackedStrings]) -> np.ndarray | None:
    """Every string of ``lists``, in order, as one fixed-width bytes array; None where that would not be
    compact (a width of over 64 bytes and 4x the strings' own bytes) or exact (a string ending in NUL)."""
    n = sum(len(p) for p in lists)
    total = sum(len(p._data) for p in lists)
    width = max((p.widest() for p in lists), default=0)
    if (width > _LONG and width * n > 4 * total) or any(p.nul_ended() for p in lists):
        return None
    out = np.empty(n, dtype=f"S{max(width, 1)}")
    at = 0
    for p in lists:
        out[at:at + len(p)] = p.encoded()
        at += len(p)
    return out


class IdSet:
    """A set of sample ids: one sorted bytes array (what the manifest held when it was made) and a Python
    set of the ids added since. Answers ``in``, ``len``, iteration, ``add``, ``update``, ``intersection``
    and ``==`` with a set, as the set it stands for."""

    def __init__(self, lists: Sequence[PackedStrings]):
        self._extra: set[str] = set()
        keys = stacked(lists)
        if keys is None:  # ids a fixed width would not hold compactly or exactly
            self._sorted = np.empty(0, dtype="S1")
            self._extra = {i for p in lists for i in p}
            return
        keys.sort()
        if len(keys) > 1:
            keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]  # an id written and also an error record
        self._sorted = keys

    def _in_sorted(self, sid: str) -> bool:
        key = sid.encode("utf-8", "surrogatepass")
        if len(key) > self._sorted.itemsize or key.endswith(b"\0") or not len(self._sorted):
            return False
        k = int(np.searchsorted(self._sorted, key))
        return k < len(self._sorted) and self._sorted[k] == key

    def __contains__(self, sid) -> bool:
        return isinstance(sid, str) and (sid in self._extra or self._in_sorted(sid))

    def __len__(self) -> int:
        return len(self._sorted) + len(self._extra)

    def __iter__(self) -> Iterator[str]:
        for key in self._sorted:
            yield key.decode("utf-8", "surrogatepass")
        yield from self._extra

    def add(self, sid: str) -> None:
        if not self._in_sorted(sid):
            self._extra.add(sid)

    def update(self, *groups: Iterable[str]) -> None:
        for group in groups:
            for sid in group:
                self.add(sid)

    def intersection(self, ids: Iterable[str]) -> set[str]:
        return {sid for sid in ids if sid in self}

    def __eq__(self, other) -> bool:
        if isinstance(other, IdSet):
            other = set(other)
        if isinstance(other, (set, frozenset)):
            return len(self) == len(other) and all(sid in self for sid in other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"IdSet({len(self)} ids)"


def repeats(lists: Sequence[PackedStrings]) -> dict[int, list[str]]:
    """For each list that holds ids an earlier list holds too, those ids (``{list number: ids}``); one
    sort of every id at once, not a set of them."""
    keys = stacked(lists)
    if keys is None:
        seen: set[str] = set()
        found = {}
        for k, p in enumerate(lists):
            if dup := seen.intersection(p):
                found[k] = sorted(dup)
            seen.update(p)
        return found
    owner = np.repeat(np.arange(len(lists), dtype=np.int64), [len(p) for p in lists])
    order = np.argsort(keys, kind="stable")  # equal ids stay in list order: a group's first is its earliest
    keys, owner = keys[order], owner[order]
    del order
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]])) if len(keys) else np.zeros(0, np.int64)
    first = np.repeat(owner[starts], np.diff(np.append(starts, len(keys))))
    later = np.flatnonzero(owner > first)
    found: dict[int, set[str]] = {}
    for j in later.tolist():
        found.setdefault(int(owner[j]), set()).add(keys[j].decode("utf-8", "surrogatepass"))
    return {k: sorted(v) for k, v in sorted(found.items())}
