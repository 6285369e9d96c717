"""Many engines, one output: ``hsx extract --ray`` (needs the ``hsx[ray]`` extra).

:func:`extract_ray` runs one :class:`~hsx.scale.worker.ExtractWorker` per engine as a Ray
actor; the driver (this process) cuts the dataset into deterministic units, commits each
finished unit to the manifest exactly once and retries a unit whose worker died on another.
Importing this package does not import Ray.
"""

from __future__ import annotations


def extract_ray(cfg, *, overwrite: bool = False, progress: bool = True):
    from hsx.scale.ray_runner import extract_ray as run

    return run(cfg, overwrite=overwrite, progress=progress)


__all__ = ["extract_ray"]
