"""How many reader threads the expert cache runs: sized by the storage device, not fixed.

Routed-expert misses of one MoE visit are read in parallel (the storage backends release
the GIL), so the useful number of readers is the number of requests the device serves at
once. :func:`device_readers` finds the block device holding a file (``st_dev`` ->
``/sys/dev/block/MAJ:MIN``, a partition's parent queue) and reads its queue:

* a rotational device (``queue/rotational`` = 1) gets ``ROTATIONAL_READERS`` (2): more
  parallel reads only add seeks; virtual disks (``vd*``, ``xvd*``) say rotational whatever
  backs them, so they go by their queue depth like any other;
* otherwise ``queue/nr_requests // REQUESTS_PER_READER`` (64), clamped to
  ``MIN_READERS..MAX_READERS`` (4..16): an NVMe queue of 1023 gets 15, a virtio or SATA
  queue of 256 or less gets 4. More readers than that only compete with the trunk reader's
  reads (docs/measurements/2026-12-01-make-bench-zen4.md, "Expert readers");
* no block device (tmpfs, a network file system, no ``/sys``): ``DEFAULT_READERS`` (4).

``--readers N`` overrides the choice; the run report names the readers and why.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_READERS = 4
ROTATIONAL_READERS = 2
MIN_READERS, MAX_READERS = 4, 16
REQUESTS_PER_READER = 64
#: the most --readers accepted
READERS_LIMIT = 64
SYS_DEV_BLOCK = Path("/sys/dev/block")
#: virtual disks (virtio, Xen) report rotational = 1 whatever backs them: go by the queue
VIRTUAL_DISKS = ("vd", "xvd")


def _queue_dir(path: Path, sys_root: Path) -> Path | None:
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    node = sys_root / f"{os.major(dev)}:{os.minor(dev)}"
    try:
        real = node.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    for d in (real, real.parent):  # a partition's queue is its disk's
        if (d / "queue").is_dir():
            return d / "queue"
    return None


def _read_int(p: Path) -> int | None:
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return None


def device_readers(path: str | Path, sys_root: Path = SYS_DEV_BLOCK) -> tuple[int, str]:
    """``(readers, why)`` for reads of ``path`` (see the module docstring)."""
    q = _queue_dir(Path(path), sys_root)
    if q is None:
        return DEFAULT_READERS, "no block device found, the default"
    name = q.parent.name
    if _read_int(q / "rotational") == 1 and not name.startswith(VIRTUAL_DISKS):
        return ROTATIONAL_READERS, f"{name} is rotational"
    nr = _read_int(q / "nr_requests")
    if nr is None:
        return DEFAULT_READERS, f"{name} has no queue depth, the default"
    n = max(MIN_READERS, min(MAX_READERS, nr // REQUESTS_PER_READER))
    return n, f"{name} queue depth {nr}"
