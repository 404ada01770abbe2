"""Writing output files atomically: a temporary name in the same directory, then rename.

A file k3 writes is either complete or absent; a failure is an ``OutputError`` (exit 3).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import OutputError


def check_writable(path: Path, what: str) -> None:
    """Refuse early when ``path`` cannot be created (missing or read-only directory)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OutputError(f"cannot write {what} {path}: it is a directory")
    if not parent.is_dir():
        raise OutputError(f"cannot write {what} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {what} {path}: directory {parent} is not writable")


def write_bytes_atomic(path: Path, data: bytes, what: str = "output") -> None:
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise OutputError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_json_atomic(path: Path, obj: Any, what: str = "output") -> None:
    write_bytes_atomic(path, (json.dumps(obj) + "\n").encode(), what)


def write_logits(path: Path, logits: np.ndarray) -> None:
    """Raw little-endian float32, no header (the reference's ``--dump-logits`` format)."""
    write_bytes_atomic(path, np.asarray(logits, dtype="<f4").tobytes(), "--dump-logits")
