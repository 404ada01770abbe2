"""The shared unbuffered read loop under a strict emulated device, and the unbuffered probe.

``StrictFile`` is ``AlignedFile`` over an ordinary descriptor whose primitive enforces the
Windows ``FILE_FLAG_NO_BUFFERING`` rules itself (address, offset and length multiples of
the sector size, else EINVAL) and can deliver short counts. It runs the whole conformance
suite on any OS, so the logic ``unbuffered`` shares with ``direct`` is tested everywhere.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from k3_storage.aligned_file import AlignedFile, BounceBuffers

from k3core.api.errors import PluginError, StorageError
from k3core.api.storage import StorageBackend
from k3core.plugins.registry import get_registry
from k3core.testing.storage_conformance import StorageConformance

SECTOR = 4096


class StrictFile(AlignedFile):
    refusal_hint = "emulated"

    def __init__(self, path: Path, backend: StrictStorage) -> None:
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        size = os.fstat(self._fd).st_size
        super().__init__(path, size, SECTOR, backend.max_chunk, backend.stats, backend.bounce)
        self.short = backend.short

    def _pread(self, buf: np.ndarray, offset: int) -> int:
        if buf.ctypes.data % SECTOR or offset % SECTOR or buf.size % SECTOR:
            raise OSError(errno.EINVAL, "Invalid argument")
        if self.short:
            buf = buf[: min(buf.size, self.short)]
        return os.preadv(self._fd, [buf.data], offset) if hasattr(os, "preadv") else _pread(self._fd, buf, offset)

    def _close_handle(self) -> None:
        os.close(self._fd)


def _pread(fd: int, buf: np.ndarray, offset: int) -> int:
    data = os.pread(fd, buf.size, offset)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return len(data)


class StrictStorage(StorageBackend):
    name = "strict"
    alignment = SECTOR

    def __init__(self, max_chunk: int = 64 << 20, short: int = 0) -> None:
        super().__init__()
        self.max_chunk = max_chunk
        self.short = short
        self.bounce = BounceBuffers()

    def open(self, path: str | Path) -> StrictFile:
        p = Path(path)
        if not p.is_file():
            raise StorageError(f"{p}: no such file")
        return StrictFile(p, self)


class TestStrictSectors(StorageConformance):
    @pytest.fixture
    def storage_backend(self) -> StorageBackend:
        return StrictStorage(max_chunk=12288)


class TestStrictShortCounts(StorageConformance):
    """The device hands back at most 5,000 bytes a call (an unaligned count)."""

    @pytest.fixture
    def storage_backend(self) -> StorageBackend:
        return StrictStorage(short=5000)


def test_unbuffered_probe_off_windows() -> None:
    reg = get_registry()
    avail = reg.probe("storage", "unbuffered")
    if sys.platform == "win32":
        assert avail.ok
        return
    assert not avail.ok and avail.reason == "Windows only: FILE_FLAG_NO_BUFFERING"
    assert "--storage" in avail.hint
    with pytest.raises(PluginError, match="Windows only"):
        reg.create("storage", "unbuffered")
    from k3_storage.unbuffered import UnbufferedStorage

    with pytest.raises(StorageError, match="Windows only"):
        UnbufferedStorage()
