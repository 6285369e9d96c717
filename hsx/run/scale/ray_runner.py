"""The Ray driver: cut the dataset into units, keep every worker busy, commit each unit exactly once.

Units are fixed windows of ``unit_size`` source rows (rows whose id appeared earlier go with
that first row, so one worker sees every row of an id and decides duplicates as the single
process does; :mod:`hsx.run.scale.units`). The driver sends a unit's rows to an idle worker; the worker writes shards into
the output directory and returns their entries; the driver checks the files are there, appends
the entries to the manifest and saves it: that save is the commit. A unit whose worker dies
(process killed, node lost) goes back to the front of the queue for the next idle worker while
Ray restarts the dead one; a unit is committed at most once, so a late or repeated attempt only
leaves uncommitted files (ignored by readers, listed by ``hsx verify``). A Ctrl-C or SIGTERM to the
driver (under the CLI, see :mod:`hsx.run.stopping`) stops the workers; what is committed stays.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from tqdm.auto import tqdm

from hsx.config import ExtractConfig
from hsx.run.core import RunSummary
from hsx.run.startup import open_rows
from hsx.errors import HsxError
from hsx.run.output import open_manifest, prepare_output
from hsx.run.scale.cluster import join_refusal, use_token_if_present
from hsx.run.scale.worker import ExtractWorker
from hsx.storage.lock import output_lock
from hsx.shards.manifest import ErrorRecord, Manifest, ShardEntry, publish, save_manifest, shard_path
from hsx.shards.packed import IdSet
from hsx.run.scale.units import Unit, dataset_units
from hsx.storage.store import as_path
from hsx.run.stopping import keep_sigterm_handler

MAX_RESTARTS = 3  # per worker, done by Ray
MAX_ATTEMPTS = 3  # per unit: a unit that kills this many workers stops the run
PROBE_SECONDS = 1.0  # how often a restarting worker is asked whether it is back
COUNTS = ("samples", "resumed", "errors", "tokens", "completion_tokens", "rows", "verify_steps", "accepted")


def connect(cfg: ExtractConfig) -> bool:
    """Join or start Ray; True if this call started it (and so should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.ray_address not in (None, "local"):
        use_token_if_present()
    try:
        with keep_sigterm_handler():  # the CLI's (SIGTERM stops the run as Ctrl-C does) wins over Ray's
            ray.init(address=cfg.ray_address, log_to_driver=False, include_dashboard=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise join_refusal(cfg.ray_address, e) from None
    return True


def _resources(cfg: ExtractConfig) -> tuple[int, float, float]:
    """(workers, CPUs per worker, GPUs per worker), the defaults filled in from the cluster."""
    import ray

    total = ray.cluster_resources()
    gpus = cfg.gpus_per_worker
    if gpus is None:
        gpus = float(cfg.engine_args.get("tp_size", 1)) if total.get("GPU", 0) and cfg.device != "cpu" else 0.0
    workers = cfg.num_workers
    if workers is None:
        workers = max(1, int(total.get("GPU", 0) // gpus) if gpus else int(total.get("CPU", 1) // cfg.cpus_per_worker))
    for name, each in (("CPU", cfg.cpus_per_worker), ("GPU", gpus)):
        if workers * each > total.get(name, 0) + 1e-9:  # Ray would wait for them forever
            raise HsxError(f"{workers} workers x {each:g} {name} need {workers * each:g} {name}s; the Ray cluster "
                           f"has {total.get(name, 0):g}. Lower --num-workers or --{name.lower()}s-per-worker, or add nodes")
    return workers, cfg.cpus_per_worker, gpus


def start_workers(cfg: ExtractConfig, dataset_meta: dict, column_names: list[str]) -> list:
    """One :class:`ExtractWorker` actor per engine the cluster has room for (:func:`_resources`)."""
    import ray

    n, cpus, gpus = _resources(cfg)
    remote = ray.remote(ExtractWorker).options(num_cpus=cpus, num_gpus=gpus, max_restarts=MAX_RESTARTS,
                                               max_task_retries=0)
    return [remote.remote(cfg.to_dict(), dataset_meta, column_names) for _ in range(n)]


def describe_workers(actors: list) -> dict:
    """The run's metadata once every worker has started; refuses workers that failed or that
    describe different runs (another hsx, model or library on some machine)."""
    import ray
    from ray.exceptions import RayActorError

    try:
        infos = ray.get([a.describe.remote() for a in actors])
    except RayActorError as e:
        raise HsxError(f"a worker could not start: {e}") from None
    for info in infos:
        if info["error"]:
            raise HsxError(f"worker on host {info['host']}: {info['error']}")
    metadata = infos[0]["metadata"]
    for info in infos[1:]:
        if info["metadata"] != metadata:
            differs = sorted(k for k in metadata if metadata.get(k) != info["metadata"].get(k))
            raise HsxError(f"workers on {infos[0]['host']} and {info['host']} describe different runs "
                           f"(metadata fields {differs}): every machine needs the same hsx, model and libraries")
    return metadata


class _Pool:
    """The workers and what each is doing; restarts are Ray's, the bookkeeping is here."""

    def __init__(self, actors):
        self.actors = actors
        self.idle = deque(range(len(actors)))
        self.running: dict = {}  # ObjectRef -> (worker, unit)
        self.probes: dict = {}  # ObjectRef -> worker being asked whether it is back
        self.due: list[tuple[float, int]] = []  # (time, worker): probe again then
        self.dead: set[int] = set()

    @property
    def alive(self) -> int:
        return len(self.idle) + len(self.running)

    def probe(self, w: int, delay: float = PROBE_SECONDS) -> None:
        self.due.append((time.monotonic() + delay, w))

    def send_probes(self) -> None:
        now = time.monotonic()
        for t, w in [d for d in self.due if d[0] <= now]:
            self.due.remove((t, w))
            self.probes[self.actors[w].describe.remote()] = w

    def busy(self) -> bool:
        return bool(self.running or self.probes or self.due)


LOST = object()  # unit_result's answer for a unit whose worker was lost


def unit_result(ref, unit: Unit, worker: int, attempts: dict[int, int]):
    """What ``unit``'s call ``ref`` on ``worker`` returned, or :data:`LOST` when the worker died (the
    unit is to run again; ``attempts`` counts it). An error raised by the work itself, or a unit that
    lost its worker ``MAX_ATTEMPTS`` times, stops the run."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    where = f"unit {unit.index} (rows {unit.rows[0]}..{unit.rows[-1]})"
    try:
        return ray.get(ref)
    except RayTaskError as e:
        cause = e.cause if isinstance(e.cause, HsxError) else e
        raise HsxError(f"{where} failed on worker {worker}: {cause}") from None
    except RayActorError as e:
        attempts[unit.index] = attempts.get(unit.index, 0) + 1
        if attempts[unit.index] >= MAX_ATTEMPTS:
            raise HsxError(f"{where} lost its worker {attempts[unit.index]} times; last: {str(e).splitlines()[0]}") from None
        return LOST


def extract_ray(cfg: ExtractConfig, *, overwrite: bool = False, progress: bool = True) -> RunSummary:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise HsxError("--ray needs Ray on every machine of the run: pip install ray (from a checkout: pip install -e '.[ray]')") from None
    cfg.validate()
    out = as_path(cfg.output)  # a shared directory, or a prefix in an object store
    with output_lock(out):
        t0 = time.perf_counter()  # the summary's seconds include Ray's start and the engines'
        started = connect(cfg)
        try:
            return _drive(cfg, out, overwrite, progress, t0)
        finally:
            if started:
                import ray

                ray.shutdown()


def _drive(cfg: ExtractConfig, out: Path, overwrite: bool, progress: bool, t0: float) -> RunSummary:
    import ray

    resume = prepare_output(out, cfg, overwrite)
    rows, dataset_meta = open_rows(cfg)
    units = dataset_units(cfg, rows)

    actors = start_workers(cfg, dataset_meta, rows.column_names)
    pool = _Pool(actors)
    try:
        metadata = describe_workers(actors)
        manifest = open_manifest(out, cfg, resume, metadata)
        publish(out, manifest.shards)  # units a crash left committed but not yet renamed
        summary = RunSummary(str(out), workers=len(actors))
        _schedule(out, rows, units, pool, manifest, summary, progress, t0)
    finally:
        for a in pool.actors:
            ray.kill(a, no_restart=True)
    manifest.complete = True
    save_manifest(out, manifest)
    summary.seconds = time.perf_counter() - t0
    summary.bytes = sum(s.bytes for s in manifest.shards)
    return summary


def _schedule(out: Path, rows, units: list[Unit], pool: _Pool, manifest: Manifest, summary: RunSummary,
              progress: bool, t0: float) -> None:
    import ray
    from ray.exceptions import ActorDiedError, RayActorError

    done = manifest.done_ids()
    queue: deque[Unit] = deque()
    for u in units:
        if all(sid in done for sid in u.ids):
            summary.resumed += len(u.ids)
        else:
            queue.append(u)  # a partly done unit: its worker skips the done rows
    attempts: dict[int, int] = {}
    committed: set[int] = set()
    bar = tqdm(total=len(rows), initial=summary.resumed, unit="sample", disable=not progress, dynamic_ncols=True)

    def postfix() -> None:
        rate = summary.tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(tok_s=f"{rate:,.0f}", errors=summary.errors, workers=f"{pool.alive}/{len(pool.actors)}")

    postfix()
    try:
        while queue or pool.running:
            while queue and pool.idle:
                w, u = pool.idle.popleft(), queue.popleft()
                unit_rows = list(zip(u.rows, rows.select(u.rows)))
                ref = pool.actors[w].run_unit.remote(u.index, unit_rows, [s for s in u.ids if s in done])
                pool.running[ref] = (w, u)
            if not pool.running and not pool.busy():
                raise HsxError(f"every worker is gone (each restarted {MAX_RESTARTS} times); {len(queue)} unit(s) "
                               f"left. Committed work is kept: run the same command again to resume")
            pool.send_probes()
            waiting = [*pool.running, *pool.probes]
            if not waiting:  # only restarting workers, none due to be asked yet
                time.sleep(0.1)
                continue
            ready, _ = ray.wait(waiting, num_returns=1, timeout=0.5)
            for ref in ready:
                if ref in pool.probes:
                    w = pool.probes.pop(ref)
                    try:
                        ray.get(ref)
                        pool.idle.append(w)
                    except ActorDiedError:
                        pool.dead.add(w)
                    except RayActorError:  # still restarting
                        pool.probe(w)
                    continue
                w, u = pool.running.pop(ref)
                result = unit_result(ref, u, w, attempts)
                if result is LOST:
                    summary.retried += 1
                    queue.appendleft(u)  # the next idle worker takes it; Ray restarts this one
                    pool.probe(w)
                    bar.write(f"hsx: worker {w} was lost during unit {u.index}; the unit goes to another worker")
                    postfix()
                    continue
                if u.index not in committed:
                    _commit(out, manifest, u, result, done)
                    committed.add(u.index)
                    for name in COUNTS:
                        setattr(summary, name, getattr(summary, name) + result["summary"][name])
                    bar.update(len(u.rows))
                pool.idle.append(w)
                postfix()
    finally:
        bar.close()


def _commit(out: Path, manifest: Manifest, unit: Unit, result: dict, done: IdSet) -> None:
    """Append one unit's shards and error records to the manifest and save it."""
    entries = [ShardEntry(**s) for s in result["shards"]]
    errors = [ErrorRecord(**e) for e in result["errors"]]
    for e in entries:
        path = shard_path(out, e.file)  # still under its staging name until the manifest below commits it
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise HsxError(f"{path}: written by the worker on host {result['host']} but not visible here: the "
                           "output directory must be one filesystem shared by every machine of the run") from None
        if size != e.bytes:
            raise HsxError(f"{path}: {size} bytes on disk, the worker on host {result['host']} wrote {e.bytes}")
    samples = [i for e in entries for i in e.sample_ids]
    again = done.intersection(samples + [r.sample_id for r in errors])
    if again or len(set(samples)) != len(samples):
        raise HsxError(f"unit {unit.index}: samples already in the output {sorted(again)[:5]}; refusing to commit twice")
    manifest.shards.extend(entries)
    manifest.errors.extend(errors)
    save_manifest(out, manifest)
    publish(out, entries)
    done.update(samples, (r.sample_id for r in errors))
