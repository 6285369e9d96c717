"""A Ray worker set-up hook for tests/test_object_store.py: the first shard upload anywhere in the
cluster writes its process id to ``$HSX_TEST_HOLD`` (created exclusively: one process wins) and then
never returns, so that the test can SIGKILL that worker in the middle of its upload."""

from __future__ import annotations

import os
import threading


def hold_first_upload() -> None:
    from hsx.storage import store

    real = store.ObjectStore.upload

    def upload(self, key, local):
        try:
            fd = os.open(os.environ["HSX_TEST_HOLD"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return real(self, key, local)
        os.write(fd, f"{os.getpid()} {key}".encode())
        os.close(fd)
        threading.Event().wait()  # until the test kills this process

    store.ObjectStore.upload = upload
