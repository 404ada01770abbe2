"""Test support: a scratch directory on a real disk, and where it is.

Storage tests must write their data on a disk-backed filesystem: ``O_DIRECT`` is refused
(or meaningless) on memory filesystems, and bandwidth figures from RAM would lie. Where:

* ``$K3_TEST_DISK_DIR`` when it is set (created if missing): the disk you want tested,
  say the one your model lives on. On a memory filesystem it is refused (``UsageError``);
* else the system temp directory when it is disk-backed;
* else (a tmpfs or ramfs ``/tmp``) ``build/k3-test-data`` under the current directory.

:func:`describe_scratch_root` says which one was taken and why, in one line; the storage suite
prints it once per session, so a run always says where it wrote.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from k3core.api.errors import UsageError

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs"}
ENV_DISK_DIR = "K3_TEST_DISK_DIR"


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


def _choose() -> tuple[Path, str]:
    env = os.environ.get(ENV_DISK_DIR, "").strip()
    if env:
        root = Path(env)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"{ENV_DISK_DIR}={env}: cannot create it: "
                             f"{exc.strerror or exc}") from None
        if is_memory_fs(root):
            raise UsageError(f"{ENV_DISK_DIR}={env} is on a memory filesystem "
                             f"({filesystem_type(root)}), not a disk",
                             hint=f"point {ENV_DISK_DIR} at a directory on a real disk")
        return root, f"from ${ENV_DISK_DIR}"
    tmp = Path(tempfile.gettempdir())
    if not is_memory_fs(tmp):
        return tmp, f"the system temp directory; set ${ENV_DISK_DIR} to test another disk"
    root = Path.cwd() / "build" / "k3-test-data"
    root.mkdir(parents=True, exist_ok=True)
    return root, (f"{tmp} is {filesystem_type(tmp)}, not a disk, and ${ENV_DISK_DIR} is "
                  "unset: under the current directory")


def disk_scratch_root() -> Path:
    """A disk-backed directory under which scratch directories may be made."""
    return _choose()[0]


def describe_scratch_root() -> str:
    """Where :func:`disk_scratch_root` is, its filesystem and why it was chosen, in one line."""
    root, why = _choose()
    fstype = filesystem_type(root)
    return f"{root}{f' ({fstype})' if fstype else ''}: {why}"


@contextmanager
def disk_tmpdir(prefix: str = "k3-test-") -> Iterator[Path]:
    """A fresh scratch directory on a real disk, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=disk_scratch_root()))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
