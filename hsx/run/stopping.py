"""SIGTERM handled as Ctrl-C: a scheduler's stop (Slurm, Kubernetes, spot preemption) drains the run.

A scheduler sends SIGTERM and, after a grace period, SIGKILL. Under :func:`sigterm_interrupts`
SIGTERM raises :class:`Terminated` in the main thread, a :class:`KeyboardInterrupt`, so it takes
the path Ctrl-C takes: the shard writer drains what is finished, the manifest commits it, and
the same command resumes. Python runs signal handlers in the main thread only, so elsewhere the
handler is left as it is.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
TERMINATED_EXIT = 128 + signal.SIGTERM  # 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would raise :class:`KeyboardInterrupt` (see the module docstring)."""


def exit_code(stop: KeyboardInterrupt) -> int:
    return TERMINATED_EXIT if isinstance(stop, Terminated) else INTERRUPTED_EXIT


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside the block, the first SIGTERM raises :class:`Terminated`; later ones are ignored, so that
    they cannot cut the drain short. The previous handler is put back on the way out."""
    if not _in_main_thread():
        yield
        return
    stopping = False

    def handler(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        # None: the handler was not set from Python; the default is what a process starts with
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextmanager
def keep_sigterm_handler() -> Iterator[None]:
    """Put back, after the block, a SIGTERM handler the caller set from Python that a library replaced
    in it (``ray.init`` installs its own, which exits without draining); a default one is left alone."""
    previous = signal.getsignal(signal.SIGTERM) if _in_main_thread() else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)
