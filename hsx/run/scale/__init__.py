"""Many engines, one output: ``hsx extract --ray`` (needs the ``hsx[ray]`` extra).

:func:`extract_ray` runs one :class:`~hsx.run.scale.worker.ExtractWorker` per engine as a Ray
actor; the driver (this process) cuts the dataset into deterministic units, commits each
finished unit to the manifest exactly once and retries a unit whose worker died on another.
:class:`~hsx.run.scale.stream.RaySource` feeds the online feed (:mod:`hsx.run.feed`) from such workers;
:class:`~hsx.run.scale.ranks.RankSource` feeds one rank of a trainer whose ranks share one pool of them.
Importing this package does not import Ray.
"""

from __future__ import annotations


def extract_ray(cfg, *, overwrite: bool = False, progress: bool = True):
    from hsx.run.scale.ray_runner import extract_ray as run

    return run(cfg, overwrite=overwrite, progress=progress)


def ray_source(cfg, ahead_units: int = 1):
    """The online feed's records from engine workers on Ray: a :class:`hsx.run.scale.stream.RaySource`."""
    from hsx.run.scale.stream import RaySource

    return RaySource(cfg, ahead_units)


def rank_source(cfg, rank: int, world: int, ahead_units: int = 1, group=None, timeout: float = 1800.0):
    """One rank's end of a pool of engine workers shared by ``world`` ranks: a :class:`hsx.run.scale.ranks.RankSource`."""
    from hsx.run.scale.ranks import RankSource

    return RankSource(cfg, rank, world, ahead_units, group, timeout)


__all__ = ["extract_ray", "ray_source", "rank_source"]
