"""The block device's own counters (``k3core.tools.bench.device_counters``): parsed from the
kernel's stat format, found for the device that holds a file, and moving with a real read."""

from __future__ import annotations

import os
from pathlib import Path

from k3core.tools.bench import device_counters as dc


def test_a_stat_line_is_bytes_read_and_busy_seconds(tmp_path) -> None:
    stat = tmp_path / "stat"
    # reads merges sectors ticks | writes merges sectors ticks | in_flight io_ticks queue ...
    stat.write_text("  1200 3 409600 900 50 0 800 40 0 1750 2000 0 0 0 0 0 0\n")
    got = dc.sample(stat)
    assert got == dc.DeviceSample(409600 * 512, 1.75)
    assert dc.sample(tmp_path / "missing") is None and dc.sample(None) is None
    stat.write_text("not a stat line\n")
    assert dc.sample(stat) is None


def test_the_device_of_a_file_counts_a_direct_read(tmp_path) -> None:
    """Where the file lies on a block device with sysfs counters, an O_DIRECT read of it shows
    in them; elsewhere (tmpfs, an overlay, not Linux) there is no stat file and no sample."""
    here = Path(__file__)
    stat = dc.stat_file_of(here)
    if stat is None:
        assert dc.device_name(None) == "" and dc.stat_file_of(tmp_path / "missing") is None
        return
    assert dc.device_name(stat) and dc.sample(stat) is not None
    data = tmp_path / "blob"
    flags = getattr(os, "O_DIRECT", 0)
    if dc.stat_file_of(data.parent) != stat or not flags:
        return  # the scratch directory is elsewhere: the read would not show on this device
    data.write_bytes(os.urandom(4 << 20))
    os.sync()
    import mmap

    before = dc.sample(stat)
    fd = os.open(data, os.O_RDONLY | flags)
    try:
        buf = mmap.mmap(-1, 4 << 20)
        assert os.preadv(fd, [buf], 0) == 4 << 20
    finally:
        os.close(fd)
    after = dc.sample(stat)
    assert before is not None and after is not None
    assert after.bytes_read - before.bytes_read >= 4 << 20
    assert after.busy_seconds >= before.busy_seconds
