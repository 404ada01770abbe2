"""The engine-shaped disk probe (k3core.tools.bench.io) at toy sizes, and the page-cache helpers."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from k3core.api.errors import UsageError
from k3core.testing.disk import disk_tmpdir
from k3core.testing.storage_conformance import write_random_file
from k3core.tools.bench import io as diskbench
from k3core.tools.bench.io import (
    RAW_BUFFERED,
    RAW_DIRECT,
    DiskBenchResult,
    probe_disk,
    raw_bandwidth,
    read_bandwidth,
    read_offsets,
)
from k3core.tools.bench.pagecache import cached_fraction, describe_cache, drop_cached

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux only")
KIB = 1024


@linux
def test_probe_directory_writes_and_removes_its_file() -> None:
    with disk_tmpdir("k3-bench-") as d:
        r = probe_disk(
            d, probe_bytes=4 << 20, read_sizes=[256 * KIB], depths=[1, 3], reads=6,
            backends=["direct", "mmap"],
        )  # fmt: skip
        assert list(d.iterdir()) == []  # the probe file is gone
    methods = [s.method for s in r.samples]
    assert methods == [RAW_DIRECT] * 2 + [RAW_BUFFERED] * 2 + ["storage direct"] * 2 + ["storage mmap"] * 2
    for s in r.samples:
        assert s.reads == 6 and s.nbytes == 6 * 256 * KIB and s.seconds > 0 and s.mb_per_s > 0
    assert r.file_size == 4 << 20 and "probe file" in r.notes[0]
    rows = r.rows()
    assert len(rows) == 8 and all(len(row) == len(DiskBenchResult.HEADER) for row in rows)
    assert rows[0][:4] == (RAW_DIRECT, "262.14 kB", "1", "6") and rows[0][7] == "bypassed"
    assert "cached" in rows[2][7]  # buffered rows say what the page cache held
    assert r.mb_per_s(RAW_BUFFERED, 256 * KIB, 3) == r.samples[3].mb_per_s
    assert r.mb_per_s(RAW_BUFFERED, 1, 3) is None


def test_probe_existing_file_kept() -> None:
    with disk_tmpdir("k3-bench-") as d:
        path = d / "model.bin"
        write_random_file(path, 1 << 20)
        r = probe_disk(path, read_sizes=[64 * KIB], depths=[2], reads=3, raw=["buffered"])
        assert path.is_file() and r.path == path and "existing file" in r.notes[0]
        assert [s.method for s in r.samples] == [RAW_BUFFERED]


@linux
def test_direct_refusal_becomes_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.open

    def refuse(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **kw)

    with disk_tmpdir("k3-bench-") as d:
        path = d / "model.bin"
        write_random_file(path, 1 << 20)
        with monkeypatch.context() as m:
            m.setattr(diskbench.os, "open", refuse)
            r = probe_disk(path, read_sizes=[64 * KIB], depths=[1], reads=2)
    assert [s.method for s in r.samples] == [RAW_BUFFERED]
    assert any("O_DIRECT skipped" in n for n in r.notes)


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        probe_disk(tmp_path / "missing")
    with pytest.raises(UsageError, match="free"):
        probe_disk(tmp_path, probe_bytes=1 << 60)
    small = tmp_path / "small.bin"
    write_random_file(small, 1000)
    with pytest.raises(UsageError, match="does not fit"):
        raw_bandwidth(small, 4096, direct=False)
    with pytest.raises(UsageError, match="multiple of 4096"):
        raw_bandwidth(small, 100, direct=True)
    with pytest.raises(UsageError, match="queue depth"):
        raw_bandwidth(small, 100, depth=0, direct=False)
    assert list(tmp_path.iterdir()) == [small]


def test_read_offsets_random_aligned_disjoint() -> None:
    size, n = (10 << 20) + 123, 1 << 20
    offs = read_offsets(size, n, 9, seed=1)
    assert len(set(offs)) == 9 and all(o % 4096 == 0 and o + n <= size for o in offs)
    assert offs != sorted(offs)
    many = read_offsets(size, n, 25, seed=1)  # more reads than slots: each slot once per round
    assert sorted(many[:10]) == [i * n for i in range(10)]


def test_read_bandwidth_by_name_for_seconds() -> None:
    with disk_tmpdir("k3-bench-") as d:
        path = d / "model.bin"
        write_random_file(path, 2 << 20)
        s = read_bandwidth("mmap", path, 64 * KIB, depth=2, seconds=0.05)
    assert s.method == "storage mmap" and s.reads >= 1 and s.nbytes == s.reads * 64 * KIB
    assert s.seconds >= 0.05


def test_page_cache_helpers() -> None:
    assert describe_cache(None, None, False) == "page cache state unknown"
    assert describe_cache(0.5, 0.0, True) == "50% cached -> 0% after drop"
    assert describe_cache(0.25, None, False) == "25% cached; could not drop"
    if not sys.platform.startswith("linux"):
        return
    with disk_tmpdir() as d:
        path = d / "f.bin"
        write_random_file(path, 4 << 20)
        path.read_bytes()
        assert (cached_fraction(path) or 0) > 0.5
        os.sync()
        assert drop_cached(path)
        after = cached_fraction(path)
        assert after is not None and after < 0.5
        assert cached_fraction(d / "missing") is None and not drop_cached(d / "missing")
