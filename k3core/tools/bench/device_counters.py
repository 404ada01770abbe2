"""A block device's own counters: how long it had reads in flight, and what it read.

Linux keeps for every block device and partition the sectors it has read (field 3 of
``/sys/dev/block/MAJ:MIN/stat``) and the milliseconds during which it had at least one
request in flight (``io_ticks``, field 10). Sampled at every step of a decode run they say
how busy the disk the run streams from was, and how fast it read while busy: the rate this
run's reads actually got, where a probe before the run measures the disk at another minute
(a shared or throttled disk moves by 2x from one minute to the next). ``bytes read per
token / rate while busy`` is then the run's own disk floor, and ``busy share`` how much of
the wall time the disk was given work: a streamed run at 95 % has about 5 % left to gain
from overlap, and the rest only from reading fewer bytes.

The counters are the device's: another process reading the same disk counts too (measure
on a quiet machine). Where there is no sysfs (not Linux, or a file on no block device) the
sample is ``None`` and the bench reports nothing for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SECTOR = 512  # the unit of the stat file's sector counts, whatever the device's block size


@dataclass(frozen=True)
class DeviceSample:
    """Cumulative counters of one device at one moment."""

    bytes_read: int
    busy_seconds: float


def stat_file_of(path: Path | None) -> Path | None:
    """The sysfs ``stat`` file of the block device (or partition) that holds ``path``."""
    if path is None:
        return None
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if sample(stat) is not None else None


def sample(stat: Path | None) -> DeviceSample | None:
    """The device's counters now, or ``None`` when they cannot be read."""
    if stat is None:
        return None
    try:
        fields = stat.read_text().split()
        return DeviceSample(int(fields[2]) * SECTOR, int(fields[9]) / 1000.0)
    except (OSError, ValueError, IndexError):
        return None


def device_name(stat: Path | None) -> str:
    """The device's kernel name (``vda``, ``nvme0n1p2``), or ``""``."""
    if stat is None:
        return ""
    try:
        return stat.parent.resolve().name
    except OSError:
        return ""
