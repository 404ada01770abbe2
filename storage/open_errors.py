"""The messages every built-in backend gives when a file cannot be opened for reading."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from k3.plugin import StorageError


def open_failure(path: Path, exc: OSError) -> StorageError:
    """A one-line ``StorageError`` for a failed open (missing, a directory, no permission...)."""
    if isinstance(exc, FileNotFoundError):
        return StorageError(f"{path}: no such file")
    if isinstance(exc, IsADirectoryError):
        return StorageError(f"{path}: is a directory, not a file")
    if isinstance(exc, PermissionError):
        return StorageError(f"{path}: permission denied")
    return StorageError(f"{path}: cannot open: {exc.strerror or exc}")


def regular_size(path: Path, fd: int) -> int:
    """The size of the open ``fd``; ``StorageError`` unless it is a regular file."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise StorageError(f"{path}: is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(f"{path}: not a regular file")
    return st.st_size
