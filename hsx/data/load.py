"""Read the rows of a dataset through HF ``datasets``: a local file, a local directory, or a hub name.

``source`` is tried in this order:

1. an existing file: ``.json``/``.jsonl`` (json builder), ``.parquet``, ``.csv``; it has one split, ``train``;
2. an hsx output directory (it holds an hsx manifest): its stored samples and error records, one
   row per source row (:mod:`hsx.data.stored`);
3. an existing directory written by ``save_to_disk`` (it holds ``dataset_dict.json`` or ``state.json``);
4. any other existing directory: ``load_dataset(dir)``, which infers the format and the splits from the
   file names (``train.jsonl``, ``test-00000.parquet``, ...);
5. a builder name with ``data_files`` (``load_rows("json", data_files=[...])``);
6. otherwise a hub name. Something that looks like a path but does not exist fails here instead of
   being sent to the hub.

A source (or split) with no rows is an error naming it: an empty file, a csv with only its header.

A JSON or CSV file larger than :data:`CONVERT_APART_BYTES` is converted to Arrow (the datasets cache)
by a child process first; this process then maps the converted table. The JSON builder parses the
file's first 10 MB into Python objects (it looks for columns of mixed types): in a child, that memory
goes back to the system when the child exits instead of staying with the run. Should the child fail,
the file is read here, where a bad file gets its error naming the line.

Every failure of the underlying library surfaces as :class:`~hsx.errors.HsxError` naming the source.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import datasets
import pyarrow as pa
import xxhash

from hsx.data.convert import CONVERT_APART_BYTES, convert_apart
from hsx.data.files import FILE_BUILDERS, check_has_rows, check_json, check_utf8
from hsx.data.stored import describe_stored, is_hsx_output, load_stored_rows
from hsx.errors import HsxError

def load_rows(source: str, split: str = "train", limit: int | None = None, data_files=None) -> datasets.Dataset:
    """The rows of ``split`` of ``source``, the first ``limit`` of them when ``limit`` is given.

    A directory holding one saved ``Dataset`` (not a ``DatasetDict``) has no split names; it is
    returned whatever ``split`` says.
    """
    if limit is not None and limit < 0:
        raise HsxError(f"limit must be >= 0, got {limit}")
    splits = load_stored_rows(source) if is_hsx_output(source) else _open(source, data_files)
    if isinstance(splits, datasets.Dataset):
        # save_to_disk of a single Dataset, or an hsx output: one table, whatever the split is called
        ds = splits
    elif split in splits:
        ds = splits[split]
    else:
        raise HsxError(f"dataset {source!r} has no split {split!r}; available splits: {sorted(splits)}")
    if len(ds) == 0:
        raise HsxError(f"dataset {source!r}: no rows in split {split!r}")
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    return ds


def _open(source: str, data_files) -> datasets.DatasetDict | datasets.Dataset:
    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise HsxError(f"cannot read {source!r}: unknown file type; expected one of {sorted(FILE_BUILDERS)}")
            if builder in ("json", "csv"):
                check_utf8(path)
                if path.stat().st_size > CONVERT_APART_BYTES:
                    convert_apart(path, builder)
            try:
                with _quiet_json_log():  # its message counts rows from 0; check_json names the line
                    return datasets.load_dataset(builder, data_files={"train": str(path)})
            except Exception:
                check_has_rows(path, builder)  # an empty file fails inside the library with no message
                if builder == "json":
                    check_json(path)  # names the first bad line, if that is what went wrong
                raise
        if path.is_dir():
            if _is_saved_to_disk(path):
                return datasets.load_from_disk(str(path))
            return datasets.load_dataset(str(path), data_files=data_files)
        if data_files is None and _looks_like_path(source):
            raise HsxError(f"dataset {source!r}: no such file or directory")
        return datasets.load_dataset(source, data_files=data_files)
    except HsxError:
        raise
    except Exception as exc:  # the library raises many unrelated types; all mean "cannot read this source"
        if "corresponds to no data" in str(exc):  # its words for a split with no rows
            raise HsxError(f"dataset {source!r}: no rows (the split is empty)") from exc
        hint = ""
        if isinstance(exc, ConnectionError) or "Hub" in str(exc):
            hint = " (hub datasets need network access; download it elsewhere and pass the local path)"
        raise HsxError(f"cannot read dataset {source!r}: {type(exc).__name__}: {exc}{hint}") from exc


@contextlib.contextmanager
def _quiet_json_log():
    log = logging.getLogger("datasets.packaged_modules.json.json")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _is_saved_to_disk(path: Path) -> bool:
    return (path / datasets.config.DATASETDICT_JSON_FILENAME).is_file() or (
        path / datasets.config.DATASET_STATE_JSON_FILENAME
    ).is_file()


def _looks_like_path(source: str) -> bool:
    """A hub name is ``name`` or ``owner/name``; anything else that does not exist is a missing local path."""
    return (
        source.startswith((os.sep, ".", "~")) or source.count("/") > 1 or Path(source).suffix.lower() in FILE_BUILDERS
    )


def dataset_fingerprint(ds: datasets.Dataset) -> str:
    """The dataset's own fingerprint (it changes with content and with every transform), else a content hash."""
    fingerprint = getattr(ds, "_fingerprint", None)
    if fingerprint:
        return fingerprint
    return _table_hash(ds.data.table)


def _table_hash(table: pa.Table) -> str:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return xxhash.xxh64(sink.getvalue().to_pybytes()).hexdigest()


def describe(ds: datasets.Dataset, source: str, split: str) -> dict:
    """What shard metadata records about the input rows (an hsx output: also where its tokens came from)."""
    if is_hsx_output(source):
        return describe_stored(source, split, len(ds))
    return {"source": source, "split": split, "num_rows": len(ds), "fingerprint": dataset_fingerprint(ds)}
