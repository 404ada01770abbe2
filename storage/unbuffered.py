"""The ``unbuffered`` storage backend: Windows ``FILE_FLAG_NO_BUFFERING`` reads via ctypes.

The Windows counterpart of ``direct``: ``CreateFileW`` with ``FILE_FLAG_NO_BUFFERING |
FILE_FLAG_OVERLAPPED`` and ``ReadFile`` with an ``OVERLAPPED`` offset per read (so reads
from several threads run at once and never share a file pointer). Offsets, lengths and
buffer addresses must be multiples of the volume sector size (``GetDiskFreeSpaceW``, never
below ``ALIGN``); the options, the open and its support check, the widening, bounce
buffers, chunking and short-read handling are the ones ``direct`` uses
(:mod:`k3_storage.aligned_file`, :mod:`k3_storage.alignment`).

Available only on Windows; elsewhere the probe says so and names the alternative.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from k3_storage.aligned_file import AlignedFile, AlignedStorage
from k3_storage.alignment import is_pow2

from k3.plugin import ALIGN, Availability, StorageBackendSpec, StorageError, hookimpl

HINT = "use --storage direct on Linux, or --storage mmap"
NOT_WINDOWS = "Windows only: FILE_FLAG_NO_BUFFERING"

GENERIC_READ = 0x80000000
FILE_SHARE_ALL = 0x1 | 0x2 | 0x4  # read, write, delete
OPEN_EXISTING = 3
FILE_FLAG_NO_BUFFERING = 0x20000000
FILE_FLAG_OVERLAPPED = 0x40000000
ERROR_FILE_NOT_FOUND = 2
ERROR_PATH_NOT_FOUND = 3
ERROR_ACCESS_DENIED = 5
ERROR_HANDLE_EOF = 38
ERROR_IO_PENDING = 997


@cache
def _api() -> Any:
    """kernel32 with typed signatures (Windows only)."""
    from ctypes import wintypes as w

    class OVERLAPPED(ctypes.Structure):
        _fields_ = [
            ("Internal", ctypes.c_size_t),
            ("InternalHigh", ctypes.c_size_t),
            ("Offset", w.DWORD),
            ("OffsetHigh", w.DWORD),
            ("hEvent", w.HANDLE),
        ]

    k = getattr(ctypes, "WinDLL")("kernel32", use_last_error=True)  # noqa: B009
    pd = ctypes.POINTER(w.DWORD)
    sigs = {
        "CreateFileW": (w.HANDLE, [w.LPCWSTR, w.DWORD, w.DWORD, w.LPVOID, w.DWORD, w.DWORD, w.HANDLE]),
        "ReadFile": (w.BOOL, [w.HANDLE, w.LPVOID, w.DWORD, pd, ctypes.POINTER(OVERLAPPED)]),
        "GetOverlappedResult": (w.BOOL, [w.HANDLE, ctypes.POINTER(OVERLAPPED), pd, w.BOOL]),
        "CreateEventW": (w.HANDLE, [w.LPVOID, w.BOOL, w.BOOL, w.LPCWSTR]),
        "CloseHandle": (w.BOOL, [w.HANDLE]),
        "GetFileSizeEx": (w.BOOL, [w.HANDLE, ctypes.POINTER(ctypes.c_longlong)]),
        "GetVolumePathNameW": (w.BOOL, [w.LPCWSTR, w.LPWSTR, w.DWORD]),
        "GetDiskFreeSpaceW": (w.BOOL, [w.LPCWSTR, pd, pd, pd, pd]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(k, name)
        fn.restype, fn.argtypes = res, args
    k.OVERLAPPED = OVERLAPPED
    k.DWORD = w.DWORD
    return k


def _last_error(what: str) -> OSError:
    err = getattr(ctypes, "get_last_error")()  # noqa: B009
    exc: OSError = getattr(ctypes, "WinError")(err)  # noqa: B009  (errno mapped, e.g. 87 -> EINVAL)
    exc.strerror = f"{what}: {exc.strerror}"
    return exc


def sector_size(path: str | Path) -> int:
    """The sector size of the volume holding ``path`` (never below ``ALIGN``)."""
    k = _api()
    root = ctypes.create_unicode_buffer(1024)
    if not k.GetVolumePathNameW(str(Path(path).resolve()), root, 1024):
        return ALIGN
    spc, bps, free, total = (k.DWORD() for _ in range(4))
    refs = [ctypes.byref(x) for x in (spc, bps, free, total)]
    if not k.GetDiskFreeSpaceW(root.value, *refs) or not is_pow2(bps.value):
        return ALIGN
    return max(int(bps.value), ALIGN)


class UnbufferedFile(AlignedFile):
    """One file opened with ``FILE_FLAG_NO_BUFFERING``; ctypes calls release the GIL."""

    refusal_hint = HINT

    def _pread(self, buf: np.ndarray, offset: int) -> int:
        k = _api()
        event = k.CreateEventW(None, True, False, None)
        if not event:
            raise _last_error("CreateEventW")
        try:
            ov = k.OVERLAPPED()
            ov.Offset, ov.OffsetHigh, ov.hEvent = offset & 0xFFFFFFFF, offset >> 32, event
            n = k.DWORD(0)
            if not k.ReadFile(self._handle, buf.ctypes.data, buf.size, None, ctypes.byref(ov)):
                err = getattr(ctypes, "get_last_error")()  # noqa: B009
                if err == ERROR_HANDLE_EOF:
                    return 0
                if err != ERROR_IO_PENDING:
                    raise getattr(ctypes, "WinError")(err)  # noqa: B009
            if not k.GetOverlappedResult(self._handle, ctypes.byref(ov), ctypes.byref(n), True):
                err = getattr(ctypes, "get_last_error")()  # noqa: B009
                if err == ERROR_HANDLE_EOF:
                    return 0
                raise getattr(ctypes, "WinError")(err)  # noqa: B009
            return int(n.value)
        finally:
            k.CloseHandle(event)

    @staticmethod
    def release(handle: int) -> None:
        _api().CloseHandle(handle)


class UnbufferedStorage(AlignedStorage):
    """Windows unbuffered, overlapped reads. ``alignment=None`` asks the volume."""

    name = "unbuffered"
    file_class = UnbufferedFile
    refusal_hint = HINT

    def _check_platform(self) -> None:
        if not _is_windows():
            raise StorageError(f"the unbuffered storage backend is {NOT_WINDOWS}", hint=HINT)

    def native_alignment(self, path: Path) -> int:
        return sector_size(path)

    def _open_handle(self, p: Path) -> tuple[int, int]:
        if p.is_dir():
            raise StorageError(f"{p}: is a directory, not a file")
        k = _api()
        flags = FILE_FLAG_NO_BUFFERING | FILE_FLAG_OVERLAPPED
        h = k.CreateFileW(str(p), GENERIC_READ, FILE_SHARE_ALL, None, OPEN_EXISTING, flags, None)
        if h is None or h == ctypes.c_void_p(-1).value:
            err = getattr(ctypes, "get_last_error")()  # noqa: B009
            if err in (ERROR_FILE_NOT_FOUND, ERROR_PATH_NOT_FOUND):
                raise StorageError(f"{p}: no such file")
            if err == ERROR_ACCESS_DENIED:
                raise StorageError(f"{p}: permission denied")
            raise StorageError(f"{p}: cannot open unbuffered: {_last_error('CreateFileW')}")
        size = ctypes.c_longlong(0)
        if not k.GetFileSizeEx(h, ctypes.byref(size)):
            k.CloseHandle(h)
            raise StorageError(f"{p}: cannot read its size: {_last_error('GetFileSizeEx')}")
        return h, int(size.value)


def _is_windows() -> bool:
    return sys.platform == "win32"


def probe() -> Availability:
    if _is_windows():
        return Availability.yes()
    return Availability.no(NOT_WINDOWS, HINT)


@hookimpl
def k3_storage_backends() -> list[StorageBackendSpec]:
    return [
        StorageBackendSpec(
            name="unbuffered",
            factory="k3_storage.unbuffered:UnbufferedStorage",
            priority=30,
            probe=probe,
            description="Windows FILE_FLAG_NO_BUFFERING overlapped reads, bypassing the cache",
            install_hint=HINT,
        )
    ]
