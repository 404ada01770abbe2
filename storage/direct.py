"""The ``direct`` storage backend: Linux ``O_DIRECT`` reads, bypassing the page cache.

Each streamed layer and each expert is read once and not reused before eviction, so the
page cache only costs memory and a copy (docs/engine-behaviours.md §5). Reads go through
:class:`k3_storage.aligned_file.AlignedFile`: aligned payloads land straight in the caller's
buffer, anything else is widened to aligned windows through a per-thread bounce buffer;
the options, the open and its support check are :class:`k3_storage.aligned_file.AlignedStorage`'s.

If the filesystem refuses ``O_DIRECT`` (``EINVAL`` on open or on the first read, e.g. tmpfs
on older kernels, some FUSE mounts) :meth:`DirectStorage.open` raises ``StorageError`` with
the fix; it never falls back to buffered reads. :meth:`DirectStorage.probe_path` answers
the same question up front for a model directory (``auto`` passes ``direct`` over where it
says no).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import numpy as np
from k3_storage.aligned_file import AlignedFile, AlignedStorage
from k3_storage.open_errors import open_failure, regular_size

from k3.plugin import ALIGN, Availability, StorageBackendSpec, StorageError, hookimpl

DIRECT_HINT = "use --storage mmap, or put the model on a filesystem that supports O_DIRECT"


def logical_block_size(path: str | Path) -> int | None:
    """The logical block size of the device holding ``path`` (from sysfs), or ``None``."""
    try:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        for queue in (dev / "queue", dev.parent / "queue"):  # a partition's queue is its disk's
            f = queue / "logical_block_size"
            if f.is_file():
                value = int(f.read_text().strip())
                return value if value > 0 and value & (value - 1) == 0 else None
    except (OSError, ValueError):
        return None
    return None


def direct_alignment(path: str | Path) -> int:
    """The alignment used for ``path``: its logical block size, never below ``ALIGN``."""
    return max(logical_block_size(path) or ALIGN, ALIGN)


class DirectFile(AlignedFile):
    """One file opened ``O_DIRECT``; reads are ``os.preadv`` (which releases the GIL)."""

    refusal_hint = DIRECT_HINT

    def _pread(self, buf: np.ndarray, offset: int) -> int:
        return os.preadv(self._handle, [buf.data], offset)

    @staticmethod
    def release(handle: int) -> None:
        os.close(handle)


class DirectStorage(AlignedStorage):
    """``O_DIRECT`` reads. ``alignment=None`` queries each file's device (min ``ALIGN``)."""

    name = "direct"
    file_class = DirectFile
    refusal_hint = DIRECT_HINT

    def _check_platform(self) -> None:
        if not hasattr(os, "O_DIRECT"):
            raise StorageError(
                f"the direct storage backend needs Linux O_DIRECT (this is {sys.platform})",
                hint="use --storage mmap",
            )

    def _open_handle(self, path: Path) -> tuple[int, int]:
        flags = os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise StorageError(f"{path}: the filesystem refuses O_DIRECT (EINVAL on open)",
                                   hint=DIRECT_HINT) from exc
            raise open_failure(path, exc) from exc
        try:
            return fd, regular_size(path, fd)
        except BaseException:
            os.close(fd)
            raise

    def native_alignment(self, path: Path) -> int:
        return direct_alignment(path)


def _platform_ok() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "O_DIRECT")


def probe() -> Availability:
    """Registry probe: O_DIRECT exists here. The per-file check happens at open."""
    if _platform_ok():
        return Availability.yes()
    return Availability.no(f"O_DIRECT is Linux only (this is {sys.platform})", DIRECT_HINT)


@hookimpl
def k3_storage_backends() -> list[StorageBackendSpec]:
    return [
        StorageBackendSpec(
            name="direct",
            factory="k3_storage.direct:DirectStorage",
            priority=20,
            probe=probe,
            description="Linux O_DIRECT reads into aligned buffers, bypassing the page cache",
            install_hint=DIRECT_HINT,
        )
    ]
