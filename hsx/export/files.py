"""What every export shares: atomic files, a destination that stays inside itself, the export record.

An export directory carries ``hsx_export.json``: which shards it came from (a fingerprint of their
metadata), the export's own parameters and, once finished, ``complete: true`` with counts. A
re-run against the same source and parameters resumes; a directory exported from other shards or
with other parameters is refused rather than mixed.

The file-per-sample exports write each sample's file under a hidden temp name and rename it, with no
fsync (:func:`atomic_write` with ``durable=False``): a reader never sees a partial file, but a power
loss can bring one back empty, short or zero-filled. Nothing claims those files before they are made
durable together (:class:`Barrier`, once at the end of the loop); a resumed export keeps only files
that hold exactly the bytes it would write (:func:`holds`) and rewrites the rest.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from hsx.errors import HsxError
from hsx.shards.manifest import fsync_dir
from hsx.shards.shard import own  # noqa: F401  (the exports' helper, defined with the shard)
from hsx.storage.store import is_remote

INFO = "hsx_export.json"
# an EAGLE3 export's rows at image tokens, and what a draft is given there (the export record's vision note)
DRAFT_AT_IMAGES = ("the target's states there (boundary 0: the merged text and vision embeddings); a trainer that embeds "
                   "input_ids gives the draft the image token's own embedding at them, as SGLang's EAGLE3 draft reportedly "
                   "is given; vLLM's draft is given the vision embeddings there")


def source_name(src) -> str:
    """An export's source as its info file records it: an ``s3://`` location as given, a local path resolved."""
    return str(src) if is_remote(src) else str(Path(src).resolve())


def atomic_write(path: Path, write: Callable, *, durable: bool = True) -> int:
    """Write through ``write(file)`` to a hidden temp file beside ``path`` and rename it; returns bytes.

    ``durable``: fsync the file before the rename and the directory after it. Without, the rename is
    still atomic for readers, but the file is durable only after a :class:`Barrier` (or the kernel's
    own writeback)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return size


class _Compare:
    """A write-only file that compares what is written to it with an open file's next bytes."""

    CHUNK = 1 << 23

    def __init__(self, f):
        self.f = f
        self.same = True

    def write(self, data) -> int:
        m = memoryview(data).cast("B")
        for a in range(0, len(m), self.CHUNK):
            if not self.same:
                break
            b = m[a:a + self.CHUNK]
            self.same = self.f.read(len(b)) == b
        return len(m)

    def flush(self) -> None:
        pass


def holds(path: Path, write: Callable) -> bool:
    """Whether ``path`` holds exactly the bytes ``write(file)`` writes, compared as they are written (a few
    MB at a time: nothing the size of the file is held). A file that a power loss brought back empty,
    short or with zeros where its data was does not."""
    try:
        with open(path, "rb") as f:
            sink = _Compare(f)
            write(sink)
            return sink.same and f.read(1) == b""
    except OSError:
        return False


class Barrier:
    """Make every file written so far under ``directory`` durable, at once: ``sync()``.

    Linux ``syncfs(2)`` on a descriptor of ``directory``, opened here, before the files are written: it
    flushes the data and the directory entries of the destination's file system only (``os.sync()``,
    the fallback where libc has no ``syncfs``, waits for every file system's dirty data, a network mount's
    included), and since Linux 5.8 it reports a writeback error that happened on that file system after
    the descriptor was opened. Python's ``os`` has no ``syncfs``; it is called through ctypes. Measured
    on ext4 (2,000 and 20,000 files of 4 and 16 KB, each under a temp name and renamed): an fsync of each
    file and of its directory took 3-17x the time of the writes alone; one ``syncfs`` at the end added
    3-13% (``os.sync()`` 1-5%); an fsync of every file at the end of each group of 500, then of the
    directory, 1.9-3.4x (and would have to name the files a resumed run kept, which a killed run may
    have left in the page cache only).

    The exports call it once, after their loop and before anything that claims the files is written.
    Barriers along the way would spare a resumed export nothing: until the record says ``complete``
    it checks every file it keeps anyway, since files renamed into place but not yet durable are whole
    to every reader and only a power loss (or an OS crash) can take them back, empty, short or zeroed.
    """

    def __init__(self, directory: Path):
        self.fd = os.open(directory, os.O_RDONLY)

    def sync(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            syncfs = libc.syncfs
        except (AttributeError, OSError):
            os.sync()
            return
        syncfs.argtypes, syncfs.restype = [ctypes.c_int], ctypes.c_int
        if syncfs(self.fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LineFile:
    """A JSON-lines file written a line at a time under a hidden temp name beside ``path`` (buffered,
    nothing held per line), renamed into place by :meth:`commit`."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.f = open(self.tmp, "wb", buffering=1 << 20)
        self.lines = 0

    def add(self, obj) -> None:
        self.f.write((json.dumps(obj) + "\n").encode())
        self.lines += 1

    def close(self) -> None:
        """Write out the buffer; call before the :class:`Barrier` that makes the lines durable."""
        self.f.close()

    def commit(self, *, durable: bool = True) -> None:
        """Rename into place. ``durable``: fsync the file first (not needed after a Barrier made it
        durable) and the directory after."""
        self.f.close()
        if durable:
            fd = os.open(self.tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def inside(dst: Path, path: Path) -> Path:
    """``path`` (under ``dst``) with no symbolic link on the way: writes must stay inside ``dst``."""
    p = dst
    for part in path.relative_to(dst).parts:
        p = p / part
        if p.is_symlink():
            raise HsxError(f"{p} is a symbolic link; refusing to write through it (export into a fresh directory)")
    return path


def all_finite(t: torch.Tensor, values: int = 1 << 22) -> bool:
    """``torch.isfinite(t).all()``, a few million values at a time: the boolean mask of a whole long sample
    would be half its bfloat16 bytes."""
    if t.dim() == 0 or t.shape[0] == 0:
        return bool(torch.isfinite(t).all())
    step = max(1, values // max(1, t[0].numel()))
    return all(bool(torch.isfinite(t[a:a + step]).all()) for a in range(0, t.shape[0], step))


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:32]


def clean_temps(directory: Path) -> None:
    """Remove temp files a crashed export left in ``directory``."""
    if directory.is_dir() and not directory.is_symlink():
        for tmp in directory.glob(".*.tmp-*"):
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()


def claim(dst: Path, info: dict, foreign: Callable[[Path], bool]) -> None:
    """Make ``dst`` this export's directory: refuse another export's, or files that look foreign.

    ``info`` must hold ``source_fingerprint``; an existing record must have the same one, else
    the directory belongs to another export. Without a record, ``foreign(dst)`` says whether what
    is there already would be mixed with this export's files.
    """
    if dst.is_symlink():
        raise HsxError(f"{dst} is a symbolic link; give the real directory")
    dst.mkdir(parents=True, exist_ok=True)
    path = dst / INFO
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("format") != info["format"] or old.get("source_fingerprint") != info["source_fingerprint"]:
            raise HsxError(f"{dst} holds another export ({old.get('format')!r} of {old.get('source')!r}, other "
                           "shards or parameters); export into a new directory")
    elif foreign(dst):
        raise HsxError(f"{dst} already holds files but no {INFO}: not an hsx export; export into a new directory")
    write_json(path, {**info, "complete": False})


def vision_note(meta: dict, rows_hold: str) -> dict | None:
    """What an export of a vision-language output carries of its images and what a multimodal trainer needs
    beyond it (the export record's ``vision``); None for a text output. ``rows_hold`` says what the
    export's own rows at image tokens are."""
    v = meta.get("vision")
    if not v:
        return None
    beyond = ["the images: each sample's paths, pixel hashes, sizes and grids are in "
              "hsx.open(SOURCE)[i].vision['images'] (a trainer that runs the vision tower reads the pixels from them)"]
    if v.get("mrope"):
        beyond.append("the 3-D mRoPE positions [3, N] and rope_delta of each sample: hsx.open(SOURCE)[i].vision "
                      "['mrope_positions', 'rope_delta'] (the token order of this export is 1-D)")
    note = {"model_type": v.get("model_type"), "image_token_id": v.get("image_token_id"),
            "image_tokens": "input_ids hold each image as its block of image tokens, expanded to the processor's "
                            "count as the model ran; loss_mask is 0 on them, so no image token is learned",
            "rows_at_image_tokens": rows_hold, "not_in_this_export": beyond}
    if v.get("deepstack"):
        note["deepstack"] = v["deepstack"]
    return note
