"""The ``flaky`` storage backend: delegate every read, fail or delay some on purpose."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import numpy as np

from k3.plugin import StorageBackend, StorageError, StorageFile, UsageError, byte_view, create

ENV_INNER, ENV_FAIL, ENV_DELAY = "K3_FLAKY_INNER", "K3_FLAKY_FAIL_EVERY", "K3_FLAKY_DELAY_MS"


def _setting(value: float | None, env: str, kind: type) -> float:
    if value is not None:
        return value
    text = os.environ.get(env, "").strip()
    if not text:
        return 0
    try:
        got = kind(text)
    except ValueError:
        raise UsageError(f"{env}={text!r} is not a number") from None
    if got < 0:
        raise UsageError(f"{env}={text!r} must not be negative")
    return got


class FlakyFile(StorageFile):
    """One open file of the inner backend; every ``fail_every``-th read fails."""

    def __init__(self, backend: FlakyStorage, inner: StorageFile):
        self.path, self.size = inner.path, inner.size
        self._backend, self._inner = backend, inner

    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        b = self._backend
        if b.delay_ms:
            time.sleep(b.delay_ms / 1000.0)
        if b.fail_every and b.next_read() % b.fail_every == 0:
            view = byte_view(out)
            half = view.nbytes // 2
            if half and 0 <= offset and offset + view.nbytes <= self.size:
                self._inner.read_into(offset, view[:half])  # a torn read: some bytes arrived
            b.injected += 1
            raise StorageError(f"{self.path}: injected fault: read of {view.nbytes} bytes at "
                               f"offset {offset} failed after {half} (k3-flaky-storage)")
        self._inner.read_into(offset, out)

    def close(self) -> None:
        self._inner.close()


class FlakyStorage(StorageBackend):
    """Wraps ``inner`` (a registered storage backend name, default ``plain``)."""

    name = "flaky"

    def __init__(self, inner: str | None = None, fail_every: int | None = None,
                 delay_ms: float | None = None) -> None:
        super().__init__()
        inner_name = inner or os.environ.get(ENV_INNER, "") or "plain"
        if inner_name == self.name:
            raise UsageError("the flaky storage backend cannot wrap itself")
        self.inner: StorageBackend = create("storage", inner_name)
        self.alignment = self.inner.alignment
        self.stats = self.inner.stats  # bytes and calls are the inner backend's
        self.fail_every = int(_setting(fail_every, ENV_FAIL, int))
        self.delay_ms = float(_setting(delay_ms, ENV_DELAY, float))
        self.injected = 0
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def next_read(self) -> int:
        with self._lock:
            return next(self._count)

    def open(self, path: str | Path) -> StorageFile:
        return FlakyFile(self, self.inner.open(path))
