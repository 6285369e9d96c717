"""``hsx`` CLI runs in a child process that stop for good at a chosen point and say so on stdout, so that
a test can race or kill them deterministically: what the test sees never depends on the machine's load.
The hold is test code in the child (a wrapped library function); the library has no test hooks."""

from __future__ import annotations

import subprocess
import sys

_PRELUDE = "import sys, threading\n"
_MAIN = "from hsx.cli import main\nsys.argv = ['hsx', *sys.argv[2:]]\nmain()\n"

# Holds once the output's lock is taken, before anything is written (argv[1] unused).
AFTER_LOCK = _PRELUDE + """
import hsx.run.pipeline as pipeline
def prepare_output(*args, **kwargs):
    print("held", flush=True)
    threading.Event().wait()
pipeline.prepare_output = prepare_output
""" + _MAIN

# Holds (on the shard writer's thread) once the manifest on disk commits argv[1] shards and is not complete.
AFTER_SHARDS = _PRELUDE + """
from hsx.shards import sink
shards, real = int(sys.argv[1]), sink.ShardSink._save
def save(self):
    real(self)
    if self.persist and len(self.manifest.shards) >= shards and not self.manifest.complete:
        print("held", flush=True)
        threading.Event().wait()
sink.ShardSink._save = save
""" + _MAIN


def start(hold: str, cli_args: list[str], env: dict, arg: int = 0) -> subprocess.Popen:
    """Start ``hsx CLI_ARGS`` held at ``hold``; returns once it holds (raises if it ended first)."""
    proc = subprocess.Popen([sys.executable, "-c", hold, str(arg), *cli_args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "held":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the run ended before it held (stdout {line!r}):\n{err[-3000:]}")
    return proc
