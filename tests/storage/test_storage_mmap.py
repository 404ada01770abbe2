"""The mmap backend beyond the shared conformance suite."""

from __future__ import annotations

import threading

import pytest
from k3_storage.mmap_backend import MmapStorage

from k3core.api.errors import StorageError
from k3core.api.storage import aligned_empty
from k3core.testing.disk import disk_tmpdir
from k3core.testing.storage_conformance import write_random_file


def test_views_released_after_threaded_reads() -> None:
    with disk_tmpdir() as d:
        path = d / "a.bin"
        write_random_file(path, 1 << 20)
        f = MmapStorage().open(path)

        def reader() -> None:
            for i in range(50):
                f.read_into(i * 1000, aligned_empty(20000))

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        f.close()  # would raise if any view on the map were still alive


def test_growth_after_open_not_served() -> None:
    with disk_tmpdir() as d:
        path = d / "a.bin"
        expected = write_random_file(path, 5000)
        with MmapStorage().open(path) as f:
            with open(path, "ab") as g:
                g.write(b"x" * 5000)
            with pytest.raises(StorageError):
                f.read_into(4000, aligned_empty(2000))
            out = aligned_empty(1000)
            f.read_into(4000, out)
            assert out.tobytes() == expected[4000:]


def test_read_only_destination_refused() -> None:
    with disk_tmpdir() as d:
        path = d / "a.bin"
        write_random_file(path, 100)
        with MmapStorage().open(path) as f, pytest.raises(StorageError, match="read-only"):
            f.read_into(0, memoryview(bytes(10)))
