"""k3core.testing.faults.FaultInjector: injected read failures, for other components' tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from k3_storage.mmap_backend import MmapStorage

from k3core.api.errors import StorageError
from k3core.api.storage import StorageBackend, aligned_empty
from k3core.testing.disk import disk_tmpdir
from k3core.testing.faults import SCRIBBLE, FaultInjector
from k3core.testing.storage_conformance import SIZE, StorageConformance, write_random_file


class TestFaultyPassThrough(StorageConformance):
    """With no faults configured the wrapper is transparent."""

    @pytest.fixture
    def storage_backend(self) -> StorageBackend:
        return FaultInjector(MmapStorage())


@pytest.fixture
def data() -> Iterator[tuple[Path, bytes]]:
    with disk_tmpdir("k3-faults-") as d:
        path = d / "shard-00001.bin"
        yield path, write_random_file(path, SIZE, seed=2)


def test_fail_nth_read(data: tuple[Path, bytes]) -> None:
    path, expected = data
    storage = FaultInjector(MmapStorage(), fail_calls={2})
    with storage.open(path) as f:
        a = aligned_empty(100)
        f.read_into(0, a)
        b = aligned_empty(100)
        with pytest.raises(StorageError, match="injected fault on read #2"):
            f.read_into(100, b)
        assert (b == SCRIBBLE).all()  # a consumer that serves it anyway gets visible garbage
        f.read_into(200, b)
        assert a.tobytes() == expected[:100] and b.tobytes() == expected[200:300]
    assert storage.injected == [(path, 100, 100, 2)]
    assert storage.stats.calls == 2 and storage.stats.bytes == 200


def test_fail_byte_range(data: tuple[Path, bytes]) -> None:
    path, expected = data
    storage = FaultInjector(MmapStorage(), fail_range=(4096, 8192), scribble=False)
    with storage.open(path) as f:
        out = aligned_empty(96)
        for off in (4001, 4096, 8191):  # touching the range fails
            with pytest.raises(StorageError):
                f.read_into(off, out)
        for off in (0, 4000, 8192):  # outside it passes
            f.read_into(off, out)
            assert out.tobytes() == expected[off : off + 96]
        storage.heal()
        f.read_into(4096, out)
        assert out.tobytes() == expected[4096 : 4096 + 96]


def test_path_filter_and_read_many(data: tuple[Path, bytes]) -> None:
    path, expected = data
    other = path.parent / "other.bin"
    write_random_file(other, 1000)
    storage = FaultInjector(MmapStorage(), fail_range=(0, 50), path_contains="shard-")
    with storage.open(other) as f:
        f.read_into(0, aligned_empty(10))  # not a shard: no fault
    bufs = [np.zeros(40, np.uint8) for _ in range(4)]
    with storage.open(path) as f:
        results = f.read_many(list(zip([0, 100, 30, 200], bufs, strict=True)), depth=3)
    assert [r is not None for r in results] == [True, False, True, False]
    assert bufs[1].tobytes() == expected[100:140] and bufs[3].tobytes() == expected[200:240]
    assert sorted(o for _, o, _, _ in storage.injected) == [0, 30]
