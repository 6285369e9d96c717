"""The online feed across processes: engine workers on Ray, records back to the trainer's process.

:class:`RaySource` is what :class:`hsx.run.feed.Feed` reads when the config says ``ray``: the same
workers and units as ``hsx extract --ray`` (:func:`~hsx.run.scale.ray_runner.start_workers`,
:func:`~hsx.run.scale.units.dataset_units`), each unit run by
:meth:`~hsx.run.scale.worker.ExtractWorker.stream_unit` and its records sent back through Ray's object
store. Units are handed out in order and yielded in order; at most ``workers + ahead_units`` are
running or finished and waiting, so a slow trainer holds the workers back. A unit whose worker
dies goes to the next idle worker (Ray restarts the dead one); nothing is yielded twice, since a
unit's records are yielded only once the whole unit is back.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

from hsx.config import ExtractConfig
from hsx.run.startup import open_rows
from hsx.errors import HsxError
from hsx.run.scale.ray_runner import LOST, connect, describe_workers, start_workers, unit_result
from hsx.run.scale.units import dataset_units
from hsx.run.scale.worker import decode_item


class RaySource:
    """Records and failures of a run made by engine workers on Ray (see the module docstring)."""

    def __init__(self, cfg: ExtractConfig, ahead_units: int = 1):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise HsxError("a feed with ray = true needs Ray on every machine of the run: pip install ray (from a checkout: pip install -e '.[ray]')") from None
        self.cfg, self.ahead_units = cfg, ahead_units
        self.actors: list = []
        self.retried = 0  # units sent to a worker again after theirs was lost
        self.started = connect(cfg)
        try:
            self.rows, dataset_meta = open_rows(cfg)
            self.units = dataset_units(cfg, self.rows)
            self.actors = start_workers(cfg, dataset_meta, self.rows.column_names)
            self.metadata = describe_workers(self.actors)
        except BaseException:
            self.close()
            raise

    def items(self) -> Iterator:
        import ray

        waiting, running, done = deque(self.units), {}, {}  # running: ref -> (worker, unit); done: unit -> items
        idle = deque(range(len(self.actors)))
        attempts: dict[int, int] = {}
        limit = len(self.actors) + self.ahead_units
        order = [u.index for u in self.units]
        try:
            for index in order:
                while index not in done:
                    while waiting and idle and (len(running) + len(done) < limit or waiting[0].index == index):
                        w, u = idle.popleft(), waiting.popleft()
                        ref = self.actors[w].stream_unit.remote(list(zip(u.rows, self.rows.select(u.rows))))
                        running[ref] = (w, u)
                    if not running:
                        raise HsxError(f"no worker is left to run unit {index}")
                    (ref,), _ = ray.wait(list(running), num_returns=1)
                    w, u = running.pop(ref)
                    idle.append(w)  # a dead worker is restarted by Ray; calls to it wait until it is back
                    result = unit_result(ref, u, w, attempts)
                    if result is LOST:
                        waiting.appendleft(u)
                        self.retried += 1
                    else:
                        done[u.index] = result
                for d in done.pop(index):
                    yield decode_item(d)
        finally:
            for ref in running:
                ray.cancel(ref)

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.started:
            ray.shutdown()
            self.started = False
