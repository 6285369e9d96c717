"""One pool of engine workers feeding every rank of a trainer that spans several processes.

Rank 0 starts a :class:`FeedPool` actor on its own node (named after the job, :func:`pool_name`, in
Ray namespace ``hsx``) and hands it the dataset's rows; the pool starts the engine workers of
``extract --ray`` (:func:`~hsx.run.scale.ray_runner.start_workers`) and runs the same units. The other
ranks find the pool by name. Every rank pulls every unit from the pool, in unit order: each unit
comes as an index (the source row of each item and whether it is a failure) and one Ray object
per item (:meth:`~hsx.run.scale.worker.ExtractWorker.stream_unit_split`); the rank decides from the
index which items are its own (:class:`hsx.run.feed.Share`) and fetches only those.

Backpressure: the pool keeps at most ``workers + ahead_units`` units running or back but not yet
taken by every rank (one more while a unit whose worker died runs again), so the fastest rank is
at most that many units ahead of the slowest, and a slow rank holds the engines back.

Failure: a rank other than 0 creates a small :class:`RankLease` actor, which Ray ends when the
rank's process ends; the pool asks every lease each second, and once one is gone every rank's
next call raises an error naming that rank. The pool lives in rank 0's job, so if rank 0 ends,
the pool and its workers end with it and every other rank's next call raises an error naming
rank 0. A rank that stops a pass early, or waits longer than ``timeout`` for a rank that takes
nothing, ends that pass on every rank. No record is dropped silently: a pass either gives every
rank its whole share or fails on every rank that asks for more.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator, NamedTuple

from hsx.config import ExtractConfig
from hsx.run.startup import open_rows
from hsx.errors import HsxError
from hsx.run.scale.cluster import await_address, one_node, publish_address
from hsx.run.scale.ray_runner import LOST, connect, describe_workers, start_workers, unit_result
from hsx.run.scale.units import dataset_units
from hsx.run.scale.worker import decode_item

NAMESPACE = "hsx"  # the Ray namespace of the pools: every rank finds rank 0's there, whatever its own
POLL_SECONDS = 1.0  # a rank's call to the pool returns within this (plus the trip), so no wait is blind
LEASE_SECONDS = 1.0  # how often the pool asks whether the ranks' processes are alive
SCHEDULE_SECONDS = 0.02  # how often the pool looks for room to start a unit while others run
CALL_SECONDS = 120.0  # a call the pool does not answer in this long means the pool is stuck
CLOSE_GRACE_SECONDS = 10.0  # how long rank 0's close waits for ranks done with their passes to close theirs


class Entry(NamedTuple):
    """One item of a unit as a rank first sees it: where it comes from, and the object holding it."""

    source_index: int
    failure: bool
    ref: object  # a Ray ObjectRef to the item (encode_item's dict)


def pool_name(group: str | None) -> str:
    """The pool's actor name: the job's ``group``, else torchrun's run id and restart count, else the
    rendezvous address. Not the config: a rank with another config finds the pool and is refused."""
    if group is None:
        env = os.environ
        if "TORCHELASTIC_RUN_ID" in env:
            group = f"{env['TORCHELASTIC_RUN_ID']}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        elif "MASTER_PORT" in env:
            group = f"{env.get('MASTER_ADDR', '')}-{env['MASTER_PORT']}"
        else:
            group = "default"
    return f"hsx-feed-{group}"


class RankLease:
    """An actor a rank creates and Ray ends with the rank's process: the pool's way to see it is gone."""

    def ping(self) -> bool:
        return True


@dataclass
class _Rank:
    pass_no: int = -1  # the last pass this rank took part in
    position: int = 0  # units of that pass it has taken
    status: str = "done"  # in | done (took every unit) | left (stopped early) | closed | gone (its process ended)


class FeedPool:
    """The engine workers of a feed and every rank's place in the current pass (a threaded Ray actor)."""

    def __init__(self, cfg: dict, world: int, ahead_units: int, name: str):
        self.cfg, self.name = ExtractConfig.from_dict(cfg), name
        self.tokens: dict[int, str] = {}  # rank -> the process that joined as it
        self.world, self.ahead_units = world, ahead_units
        self.cond = threading.Condition()
        self.ranks = [_Rank() for _ in range(world)]
        self.leases: dict[int, object] = {}
        self.fingerprint = self.cfg.fingerprint()
        self.ready = False
        self.error: str | None = None  # ends the feed on every rank (a rank gone mid-pass, the start failed, rank 0 closed)
        self.pass_no, self.remainder = -1, None
        self.pass_error: str | None = None  # ends the current pass on every rank
        self.results: dict[int, tuple] = {}  # unit index -> (item index, item refs), until every rank took it
        self.units: list = []
        self.actors: list = []
        self.running = 0  # units of the current pass running on a worker
        self.retried = 0
        self.max_in_flight = 0  # most units running or back and not taken by every rank, at any time
        self.closing = False

    # --- start and membership

    def start(self, rows, dataset_meta: dict) -> None:
        """Start the engine workers on a thread of the pool's (called by rank 0; ranks see the outcome in :meth:`join`)."""
        threading.Thread(target=self._start, args=(rows, dataset_meta), name="hsx-pool-start", daemon=True).start()

    def _start(self, rows, dataset_meta: dict) -> None:
        try:
            self.rows, self.units = rows, dataset_units(self.cfg, rows)
            self.actors = start_workers(self.cfg, dataset_meta, rows.column_names)
            self.metadata = describe_workers(self.actors)
        except BaseException as e:  # every rank's join reports it
            with self.cond:
                self.error = f"the feed's engine workers did not start: {e}"
                self.cond.notify_all()
            return
        with self.cond:
            self.ready = True
            self.cond.notify_all()
        threading.Thread(target=self._watch_leases, name="hsx-pool-leases", daemon=True).start()

    def join(self, rank: int, world: int, fingerprint: str, lease, token: str) -> dict:
        """``{"ready": False}`` while the workers start, then the run's metadata and row count.
        ``token`` is the joining process's own: a second process joining as the same rank is refused."""
        if world != self.world:
            raise HsxError(f"rank {rank} says world_size {world}; rank 0 started the feed for {self.world}")
        if fingerprint != self.fingerprint:
            raise HsxError(f"rank {rank}'s config (hash {fingerprint}) is not rank 0's ({self.fingerprint}): "
                           "every rank must pass the same config")
        with self.cond:
            if self.tokens.setdefault(rank, token) != token:
                raise HsxError(f"a second process joined the feed {self.name!r} as rank {rank} (two jobs under one "
                               "name?): pass each job its own group=")
            if lease is not None:
                self.leases[rank] = lease
            if not self.ready and self.error is None:
                self.cond.wait(POLL_SECONDS)
            if self.error is not None:
                raise HsxError(self.error)
            if not self.ready:
                return {"ready": False}
            return {"ready": True, "metadata": self.metadata, "rows": len(self.rows), "units": len(self.units),
                    "workers": len(self.actors)}

    def _watch_leases(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        while not self.closing:
            time.sleep(LEASE_SECONDS)
            with self.cond:
                leases = dict(self.leases)
            pings = {lease.ping.remote(): rank for rank, lease in leases.items()}
            ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=5 * LEASE_SECONDS) if pings else ([], [])
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError:
                    self._gone(pings[ref])

    def _gone(self, rank: int) -> None:
        """Rank ``rank``'s process ended: mid-pass, the feed stops on every rank; after its last pass
        (the others may still be finishing theirs), only a further pass is refused."""
        with self.cond:
            if rank not in self.leases:  # it closed its feed (and its lease) first
                return
            r = self.ranks[rank]
            if r.status == "in" and self.error is None:
                self.error = (f"rank {rank} is gone (in pass {r.pass_no}, after {r.position} of {len(self.units)} "
                              "units): its process ended or lost its connection to Ray. The feed stops on every "
                              "rank; a restarted job runs the pass again with the same shares")
            r.status = "gone"
            self.leases.pop(rank, None)
            self.cond.notify_all()

    # --- passes

    def take(self, rank: int, pass_no: int, position: int, remainder: str) -> dict:
        """Rank ``rank`` has taken units ``< position`` of pass ``pass_no``: the next unit
        (``{"index", "refs"}``), ``{"end": True}`` after the last, or ``{"wait": [ranks holding the
        pass back]}`` when nothing came within :data:`POLL_SECONDS`. Raises when the pass or the feed failed."""
        deadline = time.monotonic() + POLL_SECONDS
        with self.cond:
            r = self.ranks[rank]
            while True:
                self._check(rank, pass_no)
                if pass_no > self.pass_no:
                    ended = [f"rank {k} {o.status}" for k, o in enumerate(self.ranks) if o.status in ("closed", "gone")]
                    if ended:
                        raise HsxError(f"{', '.join(ended)} after pass {self.pass_no}: no further pass can run without it")
                    holding = [k for k, o in enumerate(self.ranks) if o.pass_no != self.pass_no or o.status == "in"]
                    if not holding:
                        self._start_pass(pass_no, remainder)
                        continue
                    if not self._wait(deadline):
                        return {"wait": [k for k in holding if k != rank]}
                    continue
                if remainder != self.remainder:
                    raise HsxError(f"rank {rank} asks for remainder={remainder!r} in pass {pass_no}, another rank "
                                   f"for {self.remainder!r}: every rank must split the pass the same way")
                if r.pass_no != pass_no:
                    r.pass_no, r.status = pass_no, "in"
                r.position = position
                self._free()
                self.cond.notify_all()  # room for the scheduler, maybe
                if position >= len(self.units):
                    return {"end": True}  # the rank says when it has fetched what it needs: finish()
                if position in self.results:
                    index, refs = self.results[position]
                    return {"index": index, "refs": refs}
                if not self._wait(deadline):
                    return {"wait": self._holding(position)}

    def finish(self, rank: int, pass_no: int) -> None:
        """Rank ``rank`` has its whole share of pass ``pass_no`` (fetched, padding too)."""
        with self.cond:
            r = self.ranks[rank]
            if r.pass_no == pass_no and r.status == "in":
                r.status = "done"
            self.cond.notify_all()

    def leave(self, rank: int, pass_no: int, position: int, reason: str) -> None:
        """Rank ``rank`` stopped pass ``pass_no`` after taking ``position`` units: the pass ends on every rank."""
        with self.cond:
            r = self.ranks[rank]
            if pass_no == self.pass_no and r.pass_no == pass_no and r.status == "in":
                r.status = "left"
                if self.pass_error is None:
                    self.pass_error = (f"rank {rank} {reason} in pass {pass_no}, after {position} of "
                                       f"{len(self.units)} units; a pass is shared, so it ends on every rank")
            self.cond.notify_all()

    def close_rank(self, rank: int) -> None:
        """Rank ``rank`` closed its feed: the pass it was in (if it had not finished it) ends, and no
        further pass can start without it; a pass it finished goes on for the others."""
        with self.cond:
            r = self.ranks[rank]
            if r.status == "in" and self.pass_error is None:
                self.pass_error = f"rank {rank} closed its feed in pass {r.pass_no}, after {r.position} units"
            r.status = "closed"
            self.leases.pop(rank, None)
            self.cond.notify_all()

    def wait_others(self, timeout: float, grace: float = CLOSE_GRACE_SECONDS) -> None:
        """Return once no rank but 0 is in a pass that can still go on (their last records fetched), or after
        ``timeout``; then once every rank that joined has closed its feed (or its process ended), or after
        ``grace`` more seconds: a rank whose ``finish`` the pool has run may still be waiting for the answer."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while any(r.status == "in" for r in self.ranks[1:]) and self.error is None and self.pass_error is None:
                if not self._wait(deadline):
                    return
            deadline = min(deadline, time.monotonic() + grace)
            while any(r.status not in ("closed", "gone") for k, r in enumerate(self.ranks) if k > 0 and k in self.tokens):
                if not self._wait(deadline):
                    return

    def shutdown(self) -> None:
        import ray

        with self.cond:
            self.closing = True
            self.error = self.error or "rank 0 closed the feed"
            self.cond.notify_all()
        for a in self.actors:
            ray.kill(a, no_restart=True)

    def stats(self) -> dict:
        with self.cond:
            return {"max_in_flight": self.max_in_flight, "limit": len(self.actors) + self.ahead_units,
                    "retried": self.retried, "units": len(self.units)}

    def _check(self, rank: int, pass_no: int) -> None:
        if self.error is not None:
            raise HsxError(self.error)
        if not self.ready:
            raise HsxError(f"rank {rank} asked for records before the feed's workers started")
        if pass_no < self.pass_no or pass_no > self.pass_no + 1:
            raise HsxError(f"rank {rank} asks for pass {pass_no} while the feed runs pass {self.pass_no}: "
                           "every rank must run the same passes")
        if pass_no == self.pass_no and self.pass_error is not None:
            raise HsxError(self.pass_error)

    def _wait(self, deadline: float) -> bool:
        """Wait on the condition until ``deadline``; False once it has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self.cond.wait(left)
        return True

    def _holding(self, position: int) -> list[int]:
        """The ranks that keep unit ``position`` from running: the slowest, while the pass is at its limit."""
        lowest = self._lowest()
        if lowest >= position or self.running + len(self.results) < len(self.actors) + self.ahead_units:
            return []  # the engines are the ones working
        return [k for k, r in enumerate(self.ranks) if (r.position if r.pass_no == self.pass_no else 0) == lowest]

    def _free(self) -> int:
        """Let go of the units every rank has taken (each holds the refs it needs); the units every rank has taken."""
        lowest = self._lowest()
        for k in [k for k in self.results if k < lowest]:
            del self.results[k]
        return lowest

    def _lowest(self) -> int:
        """Units of the current pass every rank has taken."""
        return min(r.position if r.pass_no == self.pass_no else 0 for r in self.ranks)

    def _start_pass(self, pass_no: int, remainder: str) -> None:
        self.pass_no, self.remainder, self.pass_error = pass_no, remainder, None
        self.results, self.running = {}, 0
        threading.Thread(target=self._schedule, args=(pass_no,), name=f"hsx-pool-pass-{pass_no}", daemon=True).start()

    def _schedule(self, pass_no: int) -> None:
        """Run the units of pass ``pass_no`` on the workers, in order, within the limit (see the module docstring)."""
        import ray

        waiting, running = deque(self.units), {}  # running: index ref -> (worker, unit, item refs)
        idle = deque(range(len(self.actors)))
        attempts: dict[int, int] = {}
        limit = len(self.actors) + self.ahead_units
        try:
            while True:
                with self.cond:
                    if self.pass_no != pass_no or self.error is not None or self.pass_error is not None:
                        return
                    lowest = self._free()
                    while waiting and idle and (len(running) + len(self.results) < limit or waiting[0].index == lowest):
                        w, u = idle.popleft(), waiting.popleft()
                        refs = self.actors[w].stream_unit_split.options(num_returns=len(u.rows) + 1).remote(
                            list(zip(u.rows, self.rows.select(u.rows))))
                        running[refs[0]] = (w, u, list(refs[1:]))
                    self.running = len(running)
                    self.max_in_flight = max(self.max_in_flight, len(running) + len(self.results))
                    if not running and not waiting:
                        return  # every unit is back
                    if not running:  # at the limit: the ranks must take units first
                        self.cond.wait(POLL_SECONDS)
                        continue
                ready, _ = ray.wait(list(running), num_returns=1, timeout=SCHEDULE_SECONDS)
                for ref in ready:
                    w, u, refs = running.pop(ref)
                    idle.append(w)  # a dead worker is restarted by Ray; calls to it wait until it is back
                    index = unit_result(ref, u, w, attempts)
                    with self.cond:
                        if index is LOST:
                            waiting.appendleft(u)
                            self.retried += 1
                        else:
                            self.results[u.index] = (index, refs)
                        self.running = len(running)
                        self.cond.notify_all()
        except BaseException as e:  # raised to every rank that asks for more of this pass
            with self.cond:
                if self.pass_no == pass_no and self.pass_error is None:
                    self.pass_error = f"pass {pass_no} failed: {e}"
                self.cond.notify_all()
        finally:
            for ref in running:
                ray.cancel(ref)


class PoolGone(HsxError):
    """The feed's pool ended (rank 0's job stopped or died)."""


class RankSource:
    """One rank's end of a :class:`FeedPool`: rank 0 starts the pool, every other rank finds it."""

    def __init__(self, cfg: ExtractConfig, rank: int, world: int, ahead_units: int = 1, group: str | None = None,
                 timeout: float = 1800.0):
        try:
            import ray
        except ImportError:
            raise HsxError("a feed shared by ranks needs Ray on every machine of the run: pip install ray (from a checkout: pip install -e '.[ray]')") from None
        self.cfg, self.rank, self.world, self.timeout = cfg, rank, world, timeout
        self.engine, self.pool, self.lease = None, None, None
        self.pass_no, self.position, self.reason = -1, 0, ""  # the current (or last) pass, and where it stands
        self.name = pool_name(group)
        self.published = None  # the file telling the other ranks rank 0's cluster
        self.started = self._connect()
        try:
            if rank == 0:
                self.pool = self._start_pool(ray, ahead_units)
            else:
                self.lease = ray.remote(RankLease).options(num_cpus=0, max_restarts=0).remote()
                self.pool = self._find_pool(ray)
            token = uuid.uuid4().hex
            while True:
                info = self._call(self.pool.join.remote(rank, world, cfg.fingerprint(), self.lease, token))
                if info["ready"]:
                    break
            self.metadata, self.rows, self.workers = info["metadata"], range(info["rows"]), info["workers"]
        except BaseException:
            self.close()
            raise

    def _connect(self) -> bool:
        """Join the run's one cluster (``ray_address``, else ``RAY_ADDRESS``, else ``auto``). With none
        named and every rank on this machine, rank 0 starts a local Ray it owns (``ray_address =
        "auto"`` joins one already running instead), and the other ranks join rank 0's
        (:mod:`hsx.run.scale.cluster`)."""
        address = self.cfg.ray_address or os.environ.get("RAY_ADDRESS")
        if address is not None or not one_node(self.world):
            return connect(replace(self.cfg, ray_address=address or "auto"))
        if self.rank != 0:
            return connect(replace(self.cfg, ray_address=await_address(self.name, self.rank, self.timeout)))
        import ray

        started = connect(replace(self.cfg, ray_address="local"))
        self.published = publish_address(self.name, ray.get_runtime_context().gcs_address)
        return started

    def _start_pool(self, ray, ahead_units: int):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        rows, dataset_meta = open_rows(self.cfg)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)  # reads rank 0's files
        try:
            pool = ray.remote(FeedPool).options(name=self.name, namespace=NAMESPACE, num_cpus=0, max_restarts=0,
                                                max_concurrency=self.world + 4, scheduling_strategy=here) \
                .remote(self.cfg.to_dict(), self.world, ahead_units, self.name)
        except ValueError as e:
            raise HsxError(f"rank 0: a feed named {self.name!r} already runs on this Ray cluster (another feed of "
                           f"this job, or another job): pass each its own group= ({e})") from None
        self._call(pool.start.remote(rows, dataset_meta))
        return pool

    def _find_pool(self, ray):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return ray.get_actor(self.name, namespace=NAMESPACE)
            except ValueError:
                if time.monotonic() > deadline:
                    raise HsxError(f"rank {self.rank}: rank 0 did not start the feed's pool {self.name!r} within "
                                   f"{self.timeout:g} s on the Ray cluster at {self.cfg.ray_address or 'auto'} (is every "
                                   "rank on the same cluster, with the same config?)") from None
                time.sleep(POLL_SECONDS)

    def _call(self, ref):
        """The pool's answer; its errors, and its end, as :class:`HsxError` naming this rank."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=CALL_SECONDS)
        except RayTaskError as e:
            raise HsxError(f"rank {self.rank}: {e.cause if isinstance(e.cause, HsxError) else e}") from None
        except RayActorError:
            raise PoolGone(f"rank {self.rank}: the feed's pool is gone: rank 0, whose job holds it, stopped or "
                           "died. The feed stops; a restarted job runs the pass again with the same shares") from None
        except GetTimeoutError:
            raise HsxError(f"rank {self.rank}: the feed's pool did not answer in {CALL_SECONDS:g} s") from None

    def units(self, remainder: str) -> Iterator[list[Entry]]:
        """One pass: every unit's entries, in unit order (each rank sees them all); then :meth:`end_pass`."""
        self.pass_no += 1
        self.position, self.reason = 0, "stopped its pass early"
        waiting_since = None
        while True:
            reply = self._call(self.pool.take.remote(self.rank, self.pass_no, self.position, remainder))
            if "wait" in reply:
                if not reply["wait"]:
                    waiting_since = None
                elif waiting_since is None:
                    waiting_since = time.monotonic()
                elif time.monotonic() - waiting_since > self.timeout:
                    self.reason = f"waited {self.timeout:g} s for rank(s) {reply['wait']}, which took nothing,"
                    raise HsxError(f"rank {self.rank}: waited {self.timeout:g} s in pass {self.pass_no} for rank(s) "
                                   f"{reply['wait']}, which took nothing in that time (stopped, stuck, or slower "
                                   "than the feed's rank_timeout); the pass ends on every rank")
                continue
            waiting_since = None
            if reply.get("end"):
                return
            yield [Entry(s, f, ref) for (s, f), ref in zip(reply["index"], reply["refs"])]
            self.position += 1

    def end_pass(self, finished: bool) -> None:
        """Tell the pool this rank has its whole share of the pass (``finished``), or stopped it early."""
        if finished:
            try:
                self._call(self.pool.finish.remote(self.rank, self.pass_no))
            except PoolGone:
                pass  # this rank holds its whole share; rank 0 may end the pool before the answer comes back
        else:
            p, position, reason = self.pass_no, self.position, self.reason
            self._quietly(lambda: self.pool.leave.remote(self.rank, p, position, reason))

    def fetch(self, entry: Entry):
        """The record or failure an entry stands for."""
        import ray
        from ray.exceptions import ObjectLostError, OwnerDiedError

        try:
            return decode_item(ray.get(entry.ref, timeout=CALL_SECONDS))
        except (OwnerDiedError, ObjectLostError):
            raise HsxError(f"rank {self.rank}: the item of source row {entry.source_index} is lost: the feed's pool, "
                           "which held it, is gone (rank 0 stopped or died)") from None

    def stats(self) -> dict:
        """The pool's counts (rank 0 only: the most units in flight, the limit, units run again)."""
        return self._call(self.pool.stats.remote())

    def close(self) -> None:
        import ray

        if self.pool is not None:
            if self.rank == 0:
                self._quietly(lambda: self.pool.wait_others.remote(self.timeout), self.timeout + CALL_SECONDS)
                self._quietly(lambda: self.pool.shutdown.remote())
                ray.kill(self.pool, no_restart=True)
            else:
                self._quietly(lambda: self.pool.close_rank.remote(self.rank))
            self.pool = None
        if self.lease is not None:
            with contextlib.suppress(Exception):  # rank 0 may have stopped the cluster it owned: the lease went with it
                ray.kill(self.lease, no_restart=True)
            self.lease = None
        if self.published is not None:
            self.published.unlink(missing_ok=True)
            self.published = None
        if self.started:
            ray.shutdown()
            self.started = False

    @staticmethod
    def _quietly(call, timeout: float = 10.0) -> None:
        """A courtesy call to the pool that may be gone already (its answer, or its absence, changes nothing)."""
        import ray

        try:
            ray.get(call(), timeout=timeout)
        except Exception:
            pass
