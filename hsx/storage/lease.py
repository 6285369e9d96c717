"""One writer per output in an object store: a lease object, ``PREFIX/.hsx-lease.json``.

A store has no ``flock``, so the writer holds a lease instead: a small JSON object naming it
(holder id, host, pid, start time, command) and how long it is good for (``ttl_s``). It is taken
with a conditional put (``If-None-Match: *``: only one of two runs starting at once gets it),
renewed every ``ttl_s / 3`` by a put conditional on its own last ETag, and deleted on release.

A lease not renewed for ``ttl_s`` seconds is expired; its age is read from the store's own clock
(the ``Date`` of the response minus the object's ``Last-Modified``), so clocks of the machines do
not matter. A run finding an expired lease (its writer crashed or lost the store) takes it over
with a put conditional on the expired lease's ETag, so that of two successors only one wins, and
says so. A run finding a live lease is refused, naming the holder. A holder whose renewal finds the
lease changed has lost it: its next commit raises instead of writing. The manifest's own
conditional put (:meth:`hsx.storage.store.ObjectPath.commit_bytes`) stops a writer that lost its
lease between a check and a commit.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path

from hsx.errors import HsxError
from hsx.storage.store import ConditionFailed, ObjectPath, StoreError

LEASE = ".hsx-lease.json"
LEASE_SECONDS = 60.0
log = logging.getLogger("hsx")


def describe(holder: dict | None) -> str:
    if not holder:
        return "a writer whose lease is unreadable"
    text = f"holder {holder.get('holder')}, pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
    if holder.get("command"):
        text += f" ({holder['command']})"
    return text


def _parse(raw: bytes) -> dict | None:
    try:
        holder = json.loads(raw)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


class Lease:
    """``with Lease(out):`` -- refuses with :class:`HsxError` while another run's lease on ``out`` is live."""

    def __init__(self, directory: ObjectPath, ttl_s: float | None = None):
        self.dir = directory
        self.path = directory / LEASE
        self.ttl_s = float(LEASE_SECONDS if ttl_s is None else ttl_s)
        self.taken_over: dict | None = None  # the expired lease this run took over, if any
        self.lost: str | None = None  # why the lease is no longer this run's
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.me = {"holder": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname(),
                   "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                   "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else None,
                   "ttl_s": self.ttl_s}

    def _body(self) -> bytes:
        return json.dumps({**self.me, "renewed": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}).encode()

    def acquire(self) -> "Lease":
        store, key = self.dir.store, self.path.key
        try:
            self._etag = store.put(key, self._body(), if_none_match=True)
        except ConditionFailed:
            self._take_over_expired()
        except StoreError as e:
            raise HsxError(f"cannot take the lease on {self.dir}: {e}") from None
        store.lease = self
        self._thread = threading.Thread(target=self._renew_loop, name=f"hsx-lease:{self.dir}", daemon=True)
        self._thread.start()
        return self

    def _take_over_expired(self) -> None:
        store, key = self.dir.store, self.path.key
        try:
            raw, etag, age = store.get_with_age(key)
        except FileNotFoundError:  # released between our put and our read: try once more
            self._etag = store.put(key, self._body(), if_none_match=True)
            return
        holder = _parse(raw)
        ttl = float((holder or {}).get("ttl_s", LEASE_SECONDS))
        if age < ttl:
            raise HsxError(f"{self.dir} is being written by another hsx run: {describe(holder)}; its lease "
                           f"({self.path}) was renewed {age:.0f} s ago and expires {ttl - age:.0f} s after its last "
                           "renewal. Wait for it to finish or use another --output.")
        try:
            self._etag = store.put(key, self._body(), if_match=etag)
        except ConditionFailed:
            raise HsxError(f"{self.dir}: another hsx run took over the expired lease first ({self.path}); "
                           "use another --output or wait for it to finish") from None
        self.taken_over = holder
        log.warning("%s: took over the lease of %s, not renewed for %.0f s (expired after %.0f s)",
                    self.dir, describe(holder), age, ttl)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self.renew()

    def renew(self) -> None:
        """Extend the lease. A lease changed by another run is lost; a renewal the store does not answer
        is tried again at the next turn (meanwhile a successor may take the lease over once it is expired,
        and then the manifest's conditional put refuses whichever of the two commits second)."""
        if self.lost is not None:
            return
        try:
            self._etag = self.dir.store.put(self.path.key, self._body(), if_match=self._etag)
        except ConditionFailed:
            self.lost = f"another run replaced the lease {self.path}"
        except StoreError:
            pass

    def check(self) -> None:
        """Raise if this run no longer holds the lease (called before every commit)."""
        if self.lost is not None:
            raise HsxError(f"{self.dir}: this run no longer holds the output's lease ({self.lost}); nothing more is "
                           "committed. Run the same command again to resume.")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        store = self.dir.store
        if store.lease is self:
            store.lease = None
        if self.lost is None and self._etag is not None:
            try:
                raw, _, _ = store.get_with_age(self.path.key)
                if (_parse(raw) or {}).get("holder") == self.me["holder"]:
                    store.delete(self.path.key)
            except (FileNotFoundError, StoreError) as e:  # a store that is down keeps the lease until it expires
                log.warning("%s: could not release the lease (%s); it expires %.0f s after its last renewal",
                            self.dir, e, self.ttl_s)
        self._etag = None

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
