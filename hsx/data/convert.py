"""Convert a large JSON or CSV file to Arrow (the HF datasets cache) in a child process.

HF datasets' JSON builder parses the first 10 MB of a file into Python objects to find columns of
mixed types: about 130 MB at its peak, and about half of it stays with the process that did it
(CPython does not give fragmented memory back: 73 MB more anonymous memory after a 1M-row load). Done by a short-lived child, the parse costs the run nothing
once the child exits: the caller's ``load_dataset`` finds the converted table in the cache and maps it.

The child imports only ``datasets``. It reports nothing on failure but its exit status: the caller
then reads the file itself and names what is wrong with it (the line, the column).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import datasets

log = logging.getLogger(__name__)

CONVERT_APART_BYTES = 10 << 20  # the JSON builder's first chunk: a smaller file's parse is no larger than the file

_CHILD = r"""
import logging, sys
try:
    import datasets
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    datasets.load_dataset(sys.argv[1], data_files={"train": sys.argv[2]}, cache_dir=sys.argv[3])
except Exception:
    sys.exit(3)
"""


@dataclass(frozen=True)
class Conversion:
    """What the child cost: wall and CPU seconds, its peak resident memory, and whether it converted the file."""

    seconds: float
    cpu_s: float
    peak_mb: float
    ok: bool


def convert_apart(path: Path, builder: str) -> Conversion | None:
    """Fill the datasets cache with ``path`` read by ``builder`` ("json" or "csv"), in a child process;
    None, with no child, when the cache holds it already.

    The child is given ``path`` as the caller will give it, and the cache folder the caller uses, so the
    caller's own ``load_dataset(builder, data_files={"train": str(path)})`` is a cache hit. Its
    progress bar goes to this process's stderr.
    """
    if converted(path, builder):
        return None
    cmd = [sys.executable, "-P", "-c", _CHILD, builder, str(path), str(datasets.config.HF_DATASETS_CACHE)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    except OSError as e:  # no interpreter to start (an embedded Python): the caller reads the file itself
        log.info("%s: no child process to convert it (%s); read here instead", path, e)
        return Conversion(time.perf_counter() - t0, 0.0, 0.0, False)
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # wait4: the child's own CPU and peak memory
    except BaseException:  # Ctrl-C: the child goes too
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    done = Conversion(time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
                      proc.returncode == 0)
    log.info("%s converted to Arrow by a child process: %s (%.1f s, %.1f s CPU, peak %.0f MB)", path,
             "done" if done.ok else f"exit status {proc.returncode}, read here instead", done.seconds, done.cpu_s,
             done.peak_mb, extra={"conversion": done})
    return done


def converted(path: Path, builder: str) -> bool:
    """Whether the datasets cache holds ``path`` as ``builder`` reads it today (the cache key covers the
    file's path, size and modification time)."""
    prepared = datasets.load_dataset_builder(builder, data_files={"train": str(path)})
    return Path(prepared.cache_dir, datasets.config.DATASET_INFO_FILENAME).is_file()
