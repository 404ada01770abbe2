"""The storage interface: read a byte range of a file into a caller-provided buffer.

Every byte k3 takes from disk (checkpoint tensors, packed trunk layers, routed experts)
goes through a :class:`StorageBackend`. A read either fills the whole buffer with the
file's bytes or raises :class:`k3core.errors.StorageError`; short reads are retried to
completion, and a failed read is never handed on. Backends keep :class:`IOStats`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class IOStats:
    """Bytes, seconds and calls, accumulated from any number of threads."""

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.seconds += seconds
            self.calls += 1

    def snapshot(self) -> tuple[int, float, int]:
        with self._lock:
            return self.bytes, self.seconds, self.calls

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


class StorageFile(ABC):
    """One open file. ``read_into`` may be called from several threads at once."""

    path: Path
    size: int

    @abstractmethod
    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        """Fill ``out`` (a writable contiguous byte buffer) with bytes ``[offset, offset+len)``.

        Raises ``StorageError`` if the range lies outside the file or the read fails or
        comes back short after retries; ``out`` must then be considered garbage.
        """

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> StorageFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StorageBackend(ABC):
    """A way of reading files (mmap, O_DIRECT, Windows unbuffered, ...)."""

    name: str = "?"
    #: buffer alignment this backend prefers for destination buffers (bytes)
    alignment: int = 64

    def __init__(self) -> None:
        self.stats = IOStats()

    @abstractmethod
    def open(self, path: str | Path) -> StorageFile: ...

    def timed(self) -> _Timer:
        return _Timer(self.stats)


class _Timer:
    def __init__(self, stats: IOStats):
        self.stats = stats
        self.nbytes = 0

    def __enter__(self) -> _Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.stats.add(self.nbytes, time.perf_counter() - self.t0)


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """A ``uint8`` array of ``nbytes`` whose data pointer is a multiple of ``align``."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]
