"""Which Ray cluster a run joins, and what to say when it cannot.

Ray 2.60's token authentication: a cluster started by ``ray start --head`` (or by ``ray.init()``)
once ``~/.ray/auth_token`` exists checks a token on every connection, and Ray turns it on for a
process joining by ``address="auto"`` only; a process joining by an explicit address (``HOST:PORT``,
``RAY_ADDRESS``) sends no token and fails with ``InvalidAuthToken`` after about 25 s of retries.
:func:`use_token_if_present` applies Ray's ``auto`` rule to every join: a token on this machine is
sent (a cluster without authentication ignores it).

Trainer ranks on one machine (torchrun ``--standalone``, or every rank on one node) need no cluster
started beforehand: with no address named, rank 0 starts a local Ray it owns (and stops when its
feed closes) and tells the other ranks its address through a file named after the job in the
temporary directory (:func:`publish_address`, :func:`await_address`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from hsx.errors import HsxError

NO_CLUSTER = "Could not find any running Ray instance"  # Ray's words when `auto` finds nothing
POLL_SECONDS = 0.5

START_HINT = ("start one first: `ray start --head --port 6379` on one machine (`ray start --address HEAD_IP:6379` on "
              "every other), and give every process its address (ray_address = \"HEAD_IP:6379\" in the config, or "
              "RAY_ADDRESS); Ray listens on every interface of those machines, so keep its ports behind a firewall "
              "(docs/SCALE.md)")
AUTH_HINT = ("if the cluster uses token authentication (`ray start` turns it on once ~/.ray/auth_token exists: "
             "\"Token authentication is enabled for this Ray cluster\"), this process needs the same token: "
             "~/.ray/auth_token on this machine, or RAY_AUTH_TOKEN, with RAY_AUTH_MODE=token")


def use_token_if_present() -> None:
    """Send this machine's Ray token when joining a cluster, as Ray does for ``auto`` only (module
    docstring), through Ray's own rule: ``RAY_AUTH_MODE`` set by the user wins; else a token found
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) turns token mode on, in
    the environment and in the configuration Ray cached when it was imported."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def join_refusal(address: str | None, error: Exception) -> HsxError:
    """The error for a ``ray.init`` that failed: what Ray said, and the fix."""
    said = str(error).split(". Please specify")[0]
    if NO_CLUSTER in str(error):
        return HsxError(f"cannot join Ray (address {address}): no running Ray cluster was found on this machine; "
                        f"{START_HINT}. Ranks of one torchrun on one machine need none: leave ray_address and "
                        "RAY_ADDRESS unset, and rank 0 starts a local Ray of its own")
    if address in (None, "local"):
        return HsxError(f"cannot start Ray: {said}")
    return HsxError(f"cannot join Ray (address {address}): {said}. Is a cluster running there? If not, {START_HINT}; "
                    f"{AUTH_HINT}")


def one_node(world: int) -> bool:
    """Every rank runs on this machine: torchrun's ``LOCAL_WORLD_SIZE`` equals the world size."""
    return os.environ.get("LOCAL_WORLD_SIZE") == str(world)


def address_file(name: str) -> Path:
    """Where rank 0 of the job ``name`` leaves the address of its Ray cluster for the other ranks."""
    return Path(tempfile.gettempdir()) / f"{name}.ray-address.json"


def publish_address(name: str, address: str) -> Path:
    """Rank 0: the cluster's address for the other ranks, atomically (the token, if the cluster checks
    one, is the one rank 0's Ray keeps in ``~/.ray/auth_token``: :func:`use_token_if_present` finds it)."""
    path = address_file(name)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"address": address}))
    tmp.replace(path)
    return path


def await_address(name: str, rank: int, timeout: float) -> str:
    """A rank other than 0: the address rank 0 published."""
    path, deadline = address_file(name), time.monotonic() + timeout
    while not path.is_file():
        if time.monotonic() > deadline:
            raise HsxError(f"rank {rank}: rank 0 did not say which Ray cluster the feed uses within {timeout:g} s "
                           f"(no {path}; every rank of one machine reads it): did rank 0 start, with the same "
                           "config and torchrun job?")
        time.sleep(POLL_SECONDS)
    return json.loads(path.read_text())["address"]
