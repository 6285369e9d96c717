"""One writer per output directory: an exclusive ``flock`` on ``.hsx.lock`` that names its holder.

The kernel drops a ``flock`` when the process holding it exits, however it exits, so a lock
file left behind by a killed run is recognised by the lock being free: the next run takes it
over (and says so) without guessing from pids whether the old process is still alive. The file
holds JSON (pid, host, start time, command) so that a refused run can name the one it waits for.
A clean release deletes the file while still holding the lock; a run that opened the old file
just before notices that it locked a deleted file and starts again.

On NFS, ``flock`` is carried by the server's lock manager (NFSv4 has it built in), which also
frees the locks of a client that disappears; a filesystem that cannot lock is refused.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from hsx.errors import HsxError

LOCK = ".hsx.lock"
log = logging.getLogger("hsx")


def _describe(holder: dict | None) -> str:
    if not holder:
        return "a process that has not written its details yet"
    text = f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
    if holder.get("command"):
        text += f" ({holder['command']})"
    return text


def _read(fd: int) -> dict | None:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        holder = json.loads(raw)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def unwritable(directory: str | Path, reason: str) -> HsxError:
    """The refusal of an output directory this process cannot write into (read-only mount, permissions)."""
    return HsxError(f"cannot write to {directory}: {reason} (the output directory must be writable)")


class OutputLock:
    """``with OutputLock(directory):`` -- refuses with :class:`HsxError` if another process holds it."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / LOCK
        self.taken_over: dict | None = None  # the holder details a killed run left behind, if any
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> "OutputLock":
        self._created_dir = not self.dir.exists()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise unwritable(self.dir, e.strerror) from None
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise unwritable(self.dir, e.strerror) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                for _ in range(20):  # the holder writes its details right after locking
                    if holder:
                        break
                    time.sleep(0.05)
                    holder = _read(fd)
                os.close(fd)
                raise HsxError(
                    f"{self.dir} is being written by another hsx run: {_describe(holder)}. Wait for it to "
                    f"finish or use another --output; the lock ({self.path}) is freed when that process exits."
                ) from None
            except OSError as e:
                os.close(fd)
                raise HsxError(f"{self.path}: cannot lock the output directory ({e}); it must be on a "
                               "filesystem that supports flock (local disks, NFSv4)") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # locked a file its holder deleted on release: open the current one
                os.close(fd)
                continue
            self.taken_over = _read(fd)  # a clean release deletes the file: details left mean a killed run
            if self.taken_over is not None:
                log.warning("%s: took over the lock left by %s, which no longer holds it",
                            self.dir, _describe(self.taken_over))
            me = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                  "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else None}
            data = json.dumps(me).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
            self._fd = fd
            return self
        raise HsxError(f"{self.path}: the lock file kept being replaced while trying to take it")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still holding the lock: see the module docstring
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        if self._created_dir:
            try:
                self.dir.rmdir()  # only succeeds if the run left nothing behind
            except OSError:
                pass

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def output_lock(directory):
    """The one-writer guard of an output: this ``flock`` for a local directory, a lease
    (:class:`hsx.storage.lease.Lease`) for a prefix in an object store."""
    from hsx.storage.store import as_path, is_remote

    if is_remote(directory):
        from hsx.storage.lease import Lease

        return Lease(as_path(directory))
    return OutputLock(directory)
