"""Test support: a storage backend that fails chosen reads on purpose, in-process.

:class:`FaultInjector` wraps a real backend object. A read it is told to fail raises
``StorageError`` (as a real failed or short read does) after scribbling ``0xA5`` over the
destination, so a consumer that serves a failed read anyway gets visibly wrong bytes
instead of stale right ones. Everything else passes through to the wrapped backend.

Faults are chosen by read number (1-based, counted over every file this wrapper opened, in
the order ``read_into`` is entered) and/or by file byte range (any read overlapping
``[lo, hi)`` fails), optionally only for files whose name contains a string::

    storage = FaultInjector(MmapStorage(), fail_calls={3}, fail_range=(4096, 8192))

Not a product backend: it is not registered as a plugin. The registered test backend
``faulty`` (:class:`k3core.testing.faulty_backend.FaultyStorage`, reached by name from the
command line, configured by ``K3_FAULT_*``) is the other one: torn reads after a count, at
offsets or in a range of one file, and reads held for a test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from k3core.api.errors import StorageError
from k3core.api.storage import Buffer, StorageBackend, StorageFile, byte_view

SCRIBBLE = 0xA5


class FaultInjector(StorageBackend):
    """Wraps ``inner``; see the module docstring. Attributes may be changed between reads."""

    def __init__(
        self,
        inner: StorageBackend,
        *,
        fail_calls: Iterable[int] = (),
        fail_range: tuple[int, int] | None = None,
        path_contains: str | None = None,
        scribble: bool = True,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.alignment = inner.alignment
        self.fail_calls = set(fail_calls)
        self.fail_range = fail_range
        self.path_contains = path_contains
        self.scribble = scribble
        #: every injected failure as ``(path, offset, nbytes, call number)``
        self.injected: list[tuple[Path, int, int, int]] = []
        self.calls = 0
        self._lock = threading.Lock()

    def heal(self) -> None:
        """Stop injecting faults (counting goes on)."""
        self.fail_calls = set()
        self.fail_range = None

    def open(self, path: str | Path) -> _InjectorFile:
        return _InjectorFile(self.inner.open(path), self)

    def _should_fail(self, path: Path, offset: int, nbytes: int) -> int | None:
        """Count this read; return its number if it must fail, else ``None``."""
        with self._lock:
            self.calls += 1
            call = self.calls
        if self.path_contains is not None and self.path_contains not in str(path):
            return None
        if call in self.fail_calls:
            return call
        if self.fail_range is not None:
            lo, hi = self.fail_range
            if offset < hi and lo < offset + max(nbytes, 1):
                return call
        return None


class _InjectorFile(StorageFile):
    def __init__(self, inner: StorageFile, owner: FaultInjector) -> None:
        self.inner = inner
        self.owner = owner
        self.path = inner.path
        self.size = inner.size

    def read_into(self, offset: int, out: Buffer) -> None:
        dst = byte_view(out)
        call = self.owner._should_fail(self.path, offset, dst.size)
        if call is None:
            with self.owner.timed() as t:
                self.inner.read_into(offset, dst)
                t.nbytes = dst.size
            return
        if self.owner.scribble:
            dst[:] = SCRIBBLE
        with self.owner._lock:
            self.owner.injected.append((self.path, offset, dst.size, call))
        raise StorageError(
            f"{self.path}: injected fault on read #{call} [{offset}, {offset + dst.size})"
        )

    def close(self) -> None:
        self.inner.close()
