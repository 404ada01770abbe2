"""The ``direct`` storage backend: Linux ``O_DIRECT`` reads, bypassing the page cache.

Each streamed layer and each expert is read once and not reused before eviction, so the
page cache only costs memory and a copy (docs/engine-behaviours.md §5). Reads go through
:class:`k3_storage.aligned_file.AlignedFile`: aligned payloads land straight in the caller's
buffer, anything else is widened to aligned windows through a per-thread bounce buffer.

If the filesystem refuses ``O_DIRECT`` (``EINVAL`` on open or on the first read, e.g. tmpfs
on older kernels, some FUSE mounts) :meth:`DirectStorage.open` raises ``StorageError`` with
the fix; it never falls back to buffered reads. :func:`supports_direct` answers the same
question up front for ``auto`` selection.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from k3_storage.aligned_file import AlignedFile, BounceBuffers
from k3_storage.alignment import DEFAULT_CHUNK_BYTES, check_align
from k3_storage.open_errors import open_failure, regular_size

from k3.plugin import (
    Availability,
    IOStats,
    StorageBackend,
    StorageBackendSpec,
    StorageError,
    hookimpl,
)

DIRECT_HINT = "use --storage mmap, or put the model on a filesystem that supports O_DIRECT"
#: the smallest alignment used: the page size, what the reference engine widens to
MIN_ALIGN = 4096


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
    """The alignment used for ``path``: its logical block size, never below 4096."""
    return max(logical_block_size(path) or MIN_ALIGN, MIN_ALIGN)


class DirectFile(AlignedFile):
    """One file opened ``O_DIRECT``; reads are ``os.preadv`` (which releases the GIL)."""

    refusal_hint = DIRECT_HINT

    def __init__(
        self,
        path: Path,
        fd: int,
        size: int,
        align: int,
        max_chunk: int,
        stats: IOStats,
        bounce: BounceBuffers,
    ) -> None:
        super().__init__(path, size, align, max_chunk, stats, bounce)
        self._fd = fd

    def _pread(self, buf: np.ndarray, offset: int) -> int:
        return os.preadv(self._fd, [buf.data], offset)

    def _close_handle(self) -> None:
        os.close(self._fd)


class DirectStorage(StorageBackend):
    """``O_DIRECT`` reads. ``alignment=None`` queries each file's device (min 4096)."""

    name = "direct"
    alignment = MIN_ALIGN

    def __init__(self, alignment: int | None = None, max_chunk: int = DEFAULT_CHUNK_BYTES):
        super().__init__()
        if not hasattr(os, "O_DIRECT"):
            raise StorageError(
                f"the direct storage backend needs Linux O_DIRECT (this is {sys.platform})",
                hint="use --storage mmap",
            )
        if alignment is not None:
            try:
                check_align(alignment)
            except ValueError as exc:
                raise StorageError(f"direct storage: {exc}") from exc
            if alignment < 512:
                raise StorageError(f"direct storage: alignment {alignment} is below 512")
            self.alignment = alignment
        self._fixed_align = alignment
        self.max_chunk = max_chunk
        self._bounce = BounceBuffers()

    def open(self, path: str | Path) -> DirectFile:
        p = Path(path)
        flags = os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(p, flags)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise _refused(p, "open") from exc
            raise open_failure(p, exc) from exc
        try:
            size = regular_size(p, fd)
            align = self._fixed_align or direct_alignment(p)
            f = DirectFile(p, fd, size, align, self.max_chunk, self.stats, self._bounce)
        except BaseException:
            os.close(fd)
            raise
        try:
            if size:  # the per-file support check: one aligned block, the widened path
                f._bounce_read(0, np.empty(1, dtype=np.uint8))
        except BaseException:
            f.close()
            raise
        return f


def _refused(path: Path, where: str) -> StorageError:
    return StorageError(
        f"{path}: the filesystem refuses O_DIRECT (EINVAL on {where})", hint=DIRECT_HINT
    )


def supports_direct(path: str | Path) -> Availability:
    """Can ``direct`` read ``path`` (a file, or a directory: one of its files is tried)?

    For ``auto`` selection: ``auto`` prefers ``direct`` only where this says yes. A
    directory without a non-empty regular file is tested with a small temporary file.
    """
    if not _platform_ok():
        return Availability.no("O_DIRECT is Linux only", DIRECT_HINT)
    p = Path(path)
    if p.is_dir():
        files = sorted(
            (c for c in p.iterdir() if c.is_file() and c.stat().st_size > 0),
            key=lambda c: (c.suffix != ".safetensors", c.name),
        )
        if not files:
            return _try_temp(p)
        p = files[0]
    try:
        DirectStorage().open(p).close()
    except StorageError as exc:
        return Availability.no(exc.message, exc.hint or DIRECT_HINT)
    return Availability.yes()


def _try_temp(directory: Path) -> Availability:
    try:
        fd, name = tempfile.mkstemp(prefix=".k3-odirect-", dir=directory)
    except OSError as exc:
        return Availability.no(
            f"cannot test O_DIRECT in {directory}: no file to read and not writable ({exc})",
            DIRECT_HINT,
        )
    try:
        os.write(fd, b"\0" * MIN_ALIGN)
        os.close(fd)
        return supports_direct(name)
    finally:
        os.unlink(name)


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
