"""Test support: a scratch directory on a real disk.

Storage tests must write their data on a disk-backed filesystem: ``O_DIRECT`` is refused
(or meaningless) on memory filesystems, and bandwidth figures from RAM would lie. The
system temp directory is used when it is disk-backed (on the machine k3 is developed on,
``/tmp`` is ext4); when it is tmpfs or ramfs, ``$K3_TEST_DISK_DIR`` is used if set, else
``build/k3-test-data`` under the current directory (a checkout's build folder).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs"}


def filesystem_type(path: str | Path) -> str | None:
    """The filesystem type of ``path`` from ``/proc/self/mounts`` (Linux), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    target = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, fields[2]
    except OSError:
        return None
    return fstype


def is_memory_fs(path: str | Path) -> bool:
    return filesystem_type(path) in MEMORY_FILESYSTEMS


def disk_scratch_root() -> Path:
    """A disk-backed directory under which scratch directories may be made."""
    tmp = Path(tempfile.gettempdir())
    if not is_memory_fs(tmp):
        return tmp
    env = os.environ.get("K3_TEST_DISK_DIR")
    root = Path(env) if env else Path.cwd() / "build" / "k3-test-data"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextmanager
def disk_tmpdir(prefix: str = "k3-test-") -> Iterator[Path]:
    """A fresh scratch directory on a real disk, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=disk_scratch_root()))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
