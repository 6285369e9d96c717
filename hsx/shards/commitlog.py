"""The manifest on disk since format 7 (manifest version 2): a small head, segments and a log of commits.

::

    .hsx-manifest.json                     the head: metadata, config hash, the segments in order (each
                                           with its checksum), ``log_from`` and ``complete``
    .hsx-manifest.d/segment-000003.json    the shards and error records of many commits, folded together
    .hsx-manifest.d/log-00000812.json      one commit: the shards and error records it adds, ``complete``

A commit writes one record, numbered on from the last: its bytes are what it commits, however much
the output already holds. The record is created only if no record has its number (a local file:
temp file, fsync, hard link to its name, directory fsync; a store: a put with ``If-None-Match: *``
under the run's lease), so of two writers only one makes each commit. Every ``COMPACT_EVERY``
records the writer folds the records since the last segment into a new segment, saves the head
naming it and the next record to read (locally: temp file, fsync, rename; in a store: the head's
put conditional on its ETag, as every manifest save was before), and then deletes the folded
records. A reader reads the head, its segments, and the records from ``log_from`` on until the
first number that is missing: nothing is listed. A crash leaves at most a segment the head does
not name, or folded records not yet deleted; readers ignore both and the next fold rewrites them.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from hsx.errors import ShardError
from hsx.storage.store import as_path, is_remote

LOG_DIR = ".hsx-manifest.d"
MANIFEST_VERSION = 2  # 2: head + segments + commit log (format 7); 1: one JSON file with every entry
COMPACT_EVERY = 256  # records folded into a segment at once: a reader opens at most this many records


@dataclass
class LogState:
    """What a manifest of version 2 holds on disk, as far as this process has read or written it."""

    path: Path  # the head (a local path or an object)
    head: dict  # its fields: format, version, metadata, config_hash, segments, log_from, complete
    next_record: int  # the number of the next commit's record
    shards: int  # entries on disk (segments and records together)
    errors: int
    folded_shards: int  # of which in segments
    folded_errors: int
    complete: bool  # as the last record (or the head) says
    # the unfolded entries as this process encoded them in its records (JSON text each), so that a fold
    # joins them instead of encoding them again; None when records it did not write are unfolded
    encoded: tuple[list[str], list[str]] | None = field(default=None, repr=False)

    @property
    def records(self) -> int:
        """Records not yet folded into a segment."""
        return self.next_record - self.head["log_from"]


def record_path(directory, number: int):
    return as_path(directory) / LOG_DIR / f"log-{number:08d}.json"


def segment_path(directory, number: int):
    return as_path(directory) / LOG_DIR / f"segment-{number:06d}.json"


def read_log(directory, path, head: dict, shard_of=lambda s: s) -> tuple[list, list[dict], LogState]:
    """Every shard entry (as ``shard_of`` makes it of its dict, one segment or record at a time) and error
    record (as a dict) the head's segments and the log after them hold."""
    shards, errors = [], []
    for seg in head["segments"]:
        body = _parse(_read_checked(as_path(directory) / LOG_DIR / seg["file"], seg["xxh3_128"]), seg["file"])
        shards += map(shard_of, body["shards"])
        errors += body["errors"]
    folded = len(shards), len(errors)
    complete, number = bool(head["complete"]), head["log_from"]
    first = number
    while (raw := _read_optional(record_path(directory, number))) is not None:
        body = _parse(raw, record_path(directory, number))
        if body.get("record") != number:
            raise ShardError(f"{record_path(directory, number)}: says it is record {body.get('record')!r}, "
                             f"expected {number} (a file copied in from another output?)")
        shards += map(shard_of, body["shards"])
        errors += body["errors"]
        complete = bool(body["complete"])
        number += 1
    return shards, errors, LogState(path, head, number, len(shards), len(errors), *folded, complete,
                                    ([], []) if number == first else None)


def start_log(directory, path, fields: dict, shards: list[dict], errors: list[dict], complete: bool) -> LogState:
    """Save a head for ``fields`` (metadata, config hash) whose one segment holds the entries given (none
    for a new output; every entry of an output written before format 7, which is rewritten this way once).
    A log left by a manifest this one replaces is removed first."""
    _clear(as_path(directory) / LOG_DIR)
    segments = [_write_segment(directory, 0, _encode(shards), _encode(errors))] if shards or errors else []
    head = {"format": "hsx-manifest", "version": MANIFEST_VERSION, **fields, "segments": segments,
            "log_from": 0, "complete": complete}
    _save_head(path, head)
    return LogState(path, head, 0, len(shards), len(errors), len(shards), len(errors), complete, ([], []))


def append(directory, state: LogState, shards: list[dict], errors: list[dict], complete: bool) -> None:
    """Commit ``shards`` and ``errors`` (the entries after ``state``'s) with one new record."""
    number = state.next_record
    shard_text, error_text = _encode(shards), _encode(errors)
    # the bytes json.dumps(body, separators=(",", ":")) gives, built from the entries' own texts
    body = (f'{{"record":{number},"shards":[{",".join(shard_text)}],"errors":[{",".join(error_text)}],'
            f'"complete":{"true" if complete else "false"}}}')
    _create(record_path(directory, number), body.encode())
    if state.encoded is not None:
        state.encoded[0].extend(shard_text)
        state.encoded[1].extend(error_text)
    state.next_record += 1
    state.shards += len(shards)
    state.errors += len(errors)
    state.complete = complete


def fold(directory, state: LogState, entries) -> None:
    """Fold the unfolded records into a new segment named by a new head; then delete them. What this writes
    is what those records held, plus the head. Their entries are joined from the texts this process wrote
    them with; ``entries()`` gives them as ``(shards, errors)`` dicts when records it did not write are
    among them (a resumed run's first fold)."""
    head = state.head
    if state.encoded is None:
        shards, errors = entries()
        state.encoded = (_encode(shards), _encode(errors))
    segment = _write_segment(directory, len(head["segments"]), *state.encoded)
    state.encoded = ([], [])
    folded = range(head["log_from"], state.next_record)
    new_head = {**head, "segments": [*head["segments"], segment], "log_from": state.next_record,
                "complete": state.complete}
    _save_head(state.path, new_head)
    state.head = new_head
    state.folded_shards, state.folded_errors = state.shards, state.errors
    for number in folded:
        record_path(directory, number).unlink(missing_ok=True)


def _clear(log_dir) -> None:
    """Remove the records and segments of a manifest being replaced: the new head's log starts at 0 again."""
    if not log_dir.is_dir():
        return
    for p in list(log_dir.iterdir()):
        p.unlink()


def _encode(entries: list[dict]) -> list[str]:
    return [json.dumps(e, separators=(",", ":")) for e in entries]


def _write_segment(directory, number: int, shards: list[str], errors: list[str]) -> dict:
    """A segment of the entries given as JSON texts (the bytes of ``json.dumps({"shards": ..., "errors": ...},
    separators=(",", ":"))``)."""
    data = f'{{"shards":[{",".join(shards)}],"errors":[{",".join(errors)}]}}'.encode()
    path = segment_path(directory, number)
    if not is_remote(path):
        path.parent.mkdir(exist_ok=True)
    atomic_write_bytes(path, data)  # not yet named by the head: rewriting a crashed fold's segment is safe
    return {"file": path.name, "shards": len(shards), "errors": len(errors),
            "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


def _save_head(path, head: dict) -> None:
    data = json.dumps(head, indent=1).encode()
    if is_remote(path):
        path.commit_bytes(data)  # conditional on the head this process last read or wrote
    else:
        atomic_write_bytes(path, data)


def _create(path, data: bytes) -> None:
    """Create ``path`` durably, refusing if it exists: the commit of one writer."""
    if is_remote(path):
        path.create_bytes(data)
        return
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(exist_ok=True)
        fsync_dir(path.parent.parent)
    tmp = _write_temp(path, data)
    try:
        os.link(tmp, path)  # fails if the name exists, unlike a rename
    except FileExistsError:
        raise ShardError(f"{path}: already written by another writer; this run's last commit was not made. "
                         "Only one run may write an output at a time.") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        os.replace(tmp, path)  # a filesystem without hard links: the lock keeps other writers out
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _read_optional(path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _read_checked(path, checksum: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ShardError(f"{path}: segment named by the manifest is missing") from None
    if xxhash.xxh3_128(data).hexdigest() != checksum:
        raise ShardError(f"{path}: checksum does not match the manifest's {checksum} (corrupt or rewritten)")
    return data


def _parse(raw: bytes, where) -> dict:
    try:
        body = json.loads(raw)
        body["shards"], body["errors"]
    except (ValueError, TypeError, KeyError) as e:
        raise ShardError(f"{where}: not a manifest record ({e})") from None
    return body


def _write_temp(path: Path, data: bytes) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def atomic_write_bytes(path, data: bytes) -> None:
    """Write via a temp file in the same directory, fsync, rename, fsync the directory (in a store: one put,
    which is atomic)."""
    if is_remote(path):
        as_path(path).write_bytes(data)
        return
    path = Path(path)
    os.replace(_write_temp(path, data), path)
    fsync_dir(path.parent)


def fsync_dir(directory) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
