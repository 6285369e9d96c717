"""The manifest: the list of committed shards, the source of truth for readers and resume.

A shard exists for hsx only once the manifest names it. It is written under a hidden staging
name (``.NAME.part``), committed to the manifest, and only then renamed to its visible name, so
that a tool listing the directory sees committed shards only. The manifest and the run's config
are hidden files too (``.hsx-manifest.json``, ``.hsx-config.json``): pandas, pyarrow and datasets
skip names starting with a dot. Files the manifest does not name (an attempt that never
committed, a crashed write) are ignored by readers, listed by ``hsx verify`` and overwritten by a
resumed run. Directories written before format 4 have ``manifest.json`` and ``config.json``.

In an object store (``s3://bucket/prefix``, :mod:`hsx.storage.store`) the same names are keys under
the prefix: a shard is uploaded under its staging name, the manifest is saved with a conditional put
(the commit; it fails if another writer changed the manifest since this run read it), and the shard
is then copied to its visible name and the staged copy deleted.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

from hsx.errors import ShardError
from hsx.shards import commitlog
from hsx.shards.commitlog import MANIFEST_VERSION, LogState, append, fold, fsync_dir, read_log, start_log
from hsx.shards.commitlog import atomic_write_bytes  # noqa: F401  (the run and the exports take it from here)
from hsx.shards.packed import IdSet, PackedInts, PackedStrings
from hsx.storage.store import as_path, is_remote

MANIFEST = ".hsx-manifest.json"
CONFIG = ".hsx-config.json"  # the resolved run configuration, written beside the manifest
LEGACY_MANIFEST, LEGACY_CONFIG = "manifest.json", "config.json"  # before format 4
MANIFEST_FORMAT = "hsx-manifest"


@dataclass(slots=True)
class ShardEntry:
    file: str
    samples: int
    rows: int  # hidden-state rows per column (one per covered token position)
    tokens: int
    bytes: int
    xxh3_128: str
    sample_ids: PackedStrings  # given as a list of str, held packed (hsx.shards.packed)
    source_indices: PackedInts | None = None  # per sample, as sample_ids (format 3; None in older manifests)

    def __post_init__(self):
        if not isinstance(self.sample_ids, PackedStrings):
            self.sample_ids = PackedStrings(self.sample_ids)
        if self.source_indices is not None and not isinstance(self.source_indices, PackedInts):
            self.source_indices = PackedInts(self.source_indices)

    def to_json(self) -> dict:
        """The entry as the manifest stores it: its lists as JSON lists."""
        return {"file": self.file, "samples": self.samples, "rows": self.rows, "tokens": self.tokens,
                "bytes": self.bytes, "xxh3_128": self.xxh3_128, "sample_ids": list(self.sample_ids),
                "source_indices": None if self.source_indices is None else list(self.source_indices)}


@dataclass
class ErrorRecord:
    sample_id: str
    source_index: int
    reason: str


@dataclass
class Manifest:
    metadata: dict
    config_hash: str | None = None
    shards: list[ShardEntry] = field(default_factory=list)
    errors: list[ErrorRecord] = field(default_factory=list)
    complete: bool = False
    # what is on disk already: a save writes only what came after (None: no manifest of version 2 on disk yet)
    log: LogState | None = field(default=None, repr=False, compare=False)

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def done_ids(self) -> IdSet:
        """Sample ids that need no more work: written, or recorded as errors (a set, held as one sorted array)."""
        return IdSet([*(s.sample_ids for s in self.shards), PackedStrings(e.sample_id for e in self.errors)])

    def to_json(self) -> dict:
        """Everything the manifest commits, as one JSON object (the layout of a version 1 manifest)."""
        return {"format": MANIFEST_FORMAT, "metadata": self.metadata, "config_hash": self.config_hash,
                "shards": [s.to_json() for s in self.shards], "errors": [asdict(e) for e in self.errors],
                "complete": self.complete}


FAN_OUT_FOLDER = re.compile(r"part-\d{4,}")  # the folders shards fan out to (hsx.shards.sink.fan_out)


def written_by_hsx(name: str) -> bool:
    """A name an output of hsx may hold at its top: its shards (``shard-*.parquet``) and the folders they
    fan out to (``part-0001``), the manifest and config of any format, and hidden names (staging files,
    the manifest's records, the lock, the lease), which readers skip."""
    return name.startswith(".") or (name.startswith("shard-") and name.endswith(".parquet")) \
        or FAN_OUT_FOLDER.fullmatch(name) is not None or name in (LEGACY_MANIFEST, LEGACY_CONFIG)


def foreign_names(directory: Path) -> list[str]:
    """The visible files and folders in ``directory`` that hsx did not write: pandas, pyarrow and
    ``datasets`` read every visible file of a directory as part of its dataset, so any of these
    breaks (or joins) what they read there."""
    return sorted(p.name for p in directory.iterdir() if not written_by_hsx(p.name))


def manifest_path(directory: Path) -> Path:
    """The directory's manifest: ``.hsx-manifest.json``, or ``manifest.json`` in an output written before format 4."""
    directory = as_path(directory)
    path = directory / MANIFEST
    if is_remote(directory):  # object-store outputs start at format 6: no legacy names
        return path
    legacy = directory / LEGACY_MANIFEST
    return legacy if not path.exists() and legacy.exists() else path


def staged_name(name: str) -> str:
    """Where shard ``name`` is written until the manifest commits it (hidden from directory readers): in the
    same folder, ``.NAME.part``."""
    folder, _, base = name.rpartition("/")
    return f"{folder}/.{base}.part" if folder else f".{base}.part"


def shard_path(directory: Path, name: str) -> Path:
    """A committed shard's file: its visible name, or its staging name if a crash came between the
    manifest's save and the rename (its size and checksum are checked against the manifest all the same)."""
    path = as_path(directory) / name
    staged = as_path(directory) / staged_name(name)
    return staged if not path.exists() and staged.exists() else path


def publish(directory: Path, shards: list["ShardEntry"]) -> None:
    """Rename committed shards still under their staging names to their visible names (in a store:
    copy, then delete the staged object)."""
    directory = as_path(directory)
    by_folder: dict[str, list[ShardEntry]] = {}
    for s in shards:
        by_folder.setdefault(s.file.rpartition("/")[0], []).append(s)
    for folder, entries in by_folder.items():
        _publish_folder(directory / folder if folder else directory, directory, entries)


def _publish_folder(folder: Path, directory: Path, shards: list[ShardEntry]) -> None:
    if is_remote(directory):
        staged = {p.name for p in folder.iterdir(startswith=".")}  # one listing, not one request a shard
        for s in shards:
            if staged_name(s.file).rpartition("/")[2] in staged:
                (directory / staged_name(s.file)).replace(directory / s.file)
        return
    moved = False
    for s in shards:
        staged = directory / staged_name(s.file)
        if staged.exists():
            os.replace(staged, directory / s.file)
            moved = True
    if moved:
        fsync_dir(folder)


def manifest_config_hash(directory: str | Path) -> str | None:
    """The config hash an output's manifest records, read from its head alone (a manifest of version 1 is
    all head); ``None`` when the head cannot be read (:func:`load_manifest` says why)."""
    try:
        return json.loads(manifest_path(as_path(directory)).read_text()).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None


def load_manifest(directory: str | Path) -> Manifest:
    """The manifest of an output: its head, and (version 2) its segments and commit records."""
    directory = as_path(directory)
    path = manifest_path(directory)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(f"{path}: no manifest; not an hsx output directory (or nothing was committed yet)") from None
    except ValueError as e:
        raise ShardError(f"{path}: manifest is not valid JSON ({e})") from None
    if raw.get("format") != MANIFEST_FORMAT:
        raise ShardError(f"{path}: not an hsx manifest (format={raw.get('format')!r})")
    version = raw.get("version", 1)
    try:
        if version == 1:
            shards, errors, complete, log = raw["shards"], raw.get("errors", []), raw.get("complete", False), None
            shards = [ShardEntry(**s) for s in shards]
        elif version == MANIFEST_VERSION:  # each segment's entries packed as it is read
            shards, errors, log = read_log(directory, path, raw, lambda s: ShardEntry(**s))
            complete = log.complete
        else:
            raise ShardError(f"{path}: manifest version {version!r}; this hsx reads versions 1 to {MANIFEST_VERSION} "
                             "(a newer hsx wrote it: upgrade hsx)")
        return Manifest(metadata=raw["metadata"], config_hash=raw.get("config_hash"),
                        shards=shards, errors=[ErrorRecord(**e) for e in errors],
                        complete=bool(complete), log=log)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ShardError(f"{path}: manifest is missing or has malformed fields ({e})") from None


def save_manifest(directory: str | Path, manifest: Manifest) -> None:
    """Commit what ``manifest`` holds beyond what is on disk: one record of the commit log (folded into a
    segment every ``COMPACT_EVERY`` records), so a commit writes what it commits, not the whole manifest.
    The first save of a new output, or of one written before format 7, saves a head (in a store, a put
    conditional on the head as this process last read it, see
    :meth:`hsx.storage.store.ObjectPath.commit_bytes`). A save with nothing new writes nothing."""
    directory = as_path(directory)
    log = manifest.log
    if log is None:
        fields = {"metadata": manifest.metadata, "config_hash": manifest.config_hash}
        manifest.log = start_log(directory, manifest_path(directory), fields, [s.to_json() for s in manifest.shards],
                                 [asdict(e) for e in manifest.errors], manifest.complete)
        return
    shards, errors = manifest.shards[log.shards:], manifest.errors[log.errors:]
    if not shards and not errors and manifest.complete == log.complete:
        return
    append(directory, log, [s.to_json() for s in shards], [asdict(e) for e in errors], manifest.complete)
    if log.records >= commitlog.COMPACT_EVERY:
        fold(directory, log, lambda: ([s.to_json() for s in manifest.shards[log.folded_shards:]],
                                      [asdict(e) for e in manifest.errors[log.folded_errors:]]))


def file_checksum(path: str | Path) -> str:
    """xxh3-128 of a file, hashed straight from the page cache through a memory map (no copies)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return bytes_checksum(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return bytes_checksum(m)


def streamed_checksum(path: str | Path, chunk: int = 8 << 20) -> str:
    """The same xxh3-128 as :func:`file_checksum`, read in chunks: a reader that streams a file
    does not get the whole file mapped into its resident memory."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def bytes_checksum(data) -> str:
    return xxhash.xxh3_128(data).hexdigest()
