"""A dataset directory as ``datasets.Dataset.save_to_disk`` leaves it, written one Arrow table at a time.

    DIR/data-00000-of-00002.arrow   Arrow stream files written by ``datasets``' own ArrowWriter
    DIR/data-00001-of-00002.arrow
    DIR/dataset_info.json           ``DatasetInfo(features=...)``, written by ``datasets``
    DIR/state.json                  the file list, fingerprint and format ``load_from_disk`` reads

``save_to_disk`` needs the whole dataset as one table first; this writer holds one table at a
time, so memory stays at what the caller passes to :meth:`DiskDatasetWriter.write`. Arrow files
are written under hidden temp names and renamed by :meth:`finalize`, which writes ``state.json``
last: until then the directory is not a dataset ``load_from_disk`` accepts, so a crash never
leaves a partial one that loads. The previous dataset's ``state.json`` goes first, for the same
reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from hsx.export.files import write_json
from hsx.shards.manifest import fsync_dir

STATE = "state.json"
INFO = "dataset_info.json"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskDatasetWriter:
    """Write ``pa.Table`` blocks of ``features``' schema into ``directory``; a new file every ``max_file_bytes``."""

    def __init__(self, directory: Path, features, *, fingerprint: str, format_type: str | None = None,
                 max_file_bytes: int = 1 << 30):
        self.directory = Path(directory)
        self.features = features
        self.schema = features.arrow_schema
        self.fingerprint = fingerprint
        self.format_type = format_type
        self.max_file_bytes = max_file_bytes
        self._parts: list[Path] = []
        self._writer = None
        self._file_bytes = 0
        self.rows = 0
        self.bytes = 0
        (self.directory / STATE).unlink(missing_ok=True)
        for old in self.directory.glob("data-*-of-*.arrow"):
            old.unlink()

    def write(self, table: pa.Table) -> None:
        from datasets.arrow_writer import ArrowWriter

        if not table.schema.equals(self.schema, check_metadata=False):
            raise ValueError(f"table schema {table.schema} differs from the dataset's {self.schema}")
        if self._writer is None:
            part = self.directory / f".data-{len(self._parts):05d}.arrow.tmp-{os.getpid()}"
            self._parts.append(part)
            self._writer = ArrowWriter(features=self.features, path=str(part))
            self._file_bytes = 0
        self._writer.write_table(table)
        self.rows += table.num_rows
        self._file_bytes += table.nbytes
        if self._file_bytes >= self.max_file_bytes:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.finalize()  # closes the file
            self._writer = None

    def finalize(self) -> int:
        """Name the files as ``save_to_disk`` does, then write the info and the state; returns rows."""
        import datasets

        self._close_file()
        if not self._parts:  # an empty dataset still has one (empty) file, as save_to_disk writes
            self.write(self.schema.empty_table())
            self._close_file()
        names = []
        for k, part in enumerate(self._parts):
            name = f"data-{k:05d}-of-{len(self._parts):05d}.arrow"
            _fsync(part)
            os.replace(part, self.directory / name)
            self.bytes += (self.directory / name).stat().st_size
            names.append(name)
        datasets.DatasetInfo(features=self.features).write_to_directory(str(self.directory))
        _fsync(self.directory / INFO)
        write_json(self.directory / STATE, {
            "_data_files": [{"filename": n} for n in names], "_fingerprint": self.fingerprint,
            "_format_columns": None, "_format_kwargs": {}, "_format_type": self.format_type,
            "_output_all_columns": False, "_split": None,
        })
        fsync_dir(self.directory)
        return self.rows

    def abort(self) -> None:
        """Drop what was written (temp files only; nothing final was touched but the old dataset's files)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for part in self._parts:
            part.unlink(missing_ok=True)

