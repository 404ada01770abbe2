"""The storage-backend conformance suite, shipped for built-in and third-party backends.

A backend's whole test file is one subclass and one fixture::

    from k3.testing import StorageConformance

    class TestMyStorage(StorageConformance):
        @pytest.fixture
        def storage_backend(self):
            return MyStorage()

Every check compares the backend with plain Python file reads of a random file whose size
is not a multiple of any block size: aligned, unaligned, 1-byte, zero-length, whole-file,
end-of-file and block-straddling ranges, into aligned and unaligned numpy arrays and
memoryviews, from several threads at once. It also pins the refusals: reads outside the
file, reads of a file truncated after open, reads after close, missing files and
directories all raise ``StorageError``; and ``stats`` counts bytes and calls.

Data is written on a real disk (:mod:`k3core.testing.disk`), never tmpfs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from k3core.api.errors import StorageError
from k3core.api.storage import Buffer, StorageBackend, aligned_empty
from k3core.testing.disk import disk_tmpdir

#: the test file's size: 5 x 64 KiB + 777, aligned to nothing
SIZE = 5 * 65536 + 777
_LAST_BLOCK = SIZE & ~4095

RANGES: dict[str, tuple[int, int]] = {
    "aligned": (4096, 8192),
    "aligned-large": (65536, 131072),
    "unaligned": (1234, 5000),
    "unaligned-large": (4095, 100003),
    "tiny-start": (0, 1),
    "tiny-mid": (SIZE // 2 + 3, 1),
    "tiny-last": (SIZE - 1, 1),
    "zero-start": (0, 0),
    "zero-mid": (777, 0),
    "zero-eof": (SIZE, 0),
    "whole-file": (0, SIZE),
    "eof-tail": (SIZE - 5000, 5000),
    "eof-last-block": (_LAST_BLOCK, SIZE - _LAST_BLOCK),
    "eof-straddle": (_LAST_BLOCK - 3, SIZE - _LAST_BLOCK + 3),
    "straddle-4k": (4000, 200),
    "straddle-64k": (65536 - 10, 20),
    "straddle-many": (4096 * 3 - 1, 4096 * 4 + 2),
}

BAD_RANGES: dict[str, tuple[int, int]] = {
    "negative-offset": (-1, 10),
    "past-eof": (SIZE - 5, 10),
    "start-after-eof": (SIZE + 1, 0),
    "far-past-eof": (SIZE + 100, 5),
}


def _numpy_aligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n, 4096)


def _numpy_unaligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n + 1, 4096)[1:]


def _numpy_congruent(n: int, offset: int) -> Buffer:
    """Address congruent to the file offset modulo 4096 (body readable in place)."""
    k = offset % 4096
    return aligned_empty(n + k, 4096)[k:]


def _memoryview_bytearray(n: int, offset: int) -> Buffer:
    return memoryview(bytearray(n))


def _memoryview_aligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n, 4096).data


def _memoryview_unaligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n + 3, 4096)[3:].data


DESTINATIONS: dict[str, Callable[[int, int], Buffer]] = {
    "numpy-aligned": _numpy_aligned,
    "numpy-unaligned": _numpy_unaligned,
    "numpy-congruent": _numpy_congruent,
    "memoryview-bytearray": _memoryview_bytearray,
    "memoryview-aligned": _memoryview_aligned,
    "memoryview-unaligned": _memoryview_unaligned,
}


def write_random_file(path: Path, size: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def python_read(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


class StorageConformance:
    """Subclass and provide the ``storage_backend`` fixture (a fresh backend instance)."""

    @pytest.fixture
    def storage_backend(self) -> StorageBackend:
        raise NotImplementedError("a StorageConformance subclass must provide storage_backend")

    @pytest.fixture
    def data_dir(self) -> Iterator[Path]:
        with disk_tmpdir("k3-storage-") as d:
            yield d

    @pytest.fixture
    def data_file(self, data_dir: Path) -> Path:
        path = data_dir / "data.bin"
        write_random_file(path, SIZE)
        return path

    # ---- correct bytes ----------------------------------------------------------------
    @pytest.mark.parametrize("dest", list(DESTINATIONS))
    @pytest.mark.parametrize("rng", list(RANGES))
    def test_range_matches_python(
        self, storage_backend: StorageBackend, data_file: Path, rng: str, dest: str
    ) -> None:
        offset, n = RANGES[rng]
        out = DESTINATIONS[dest](n, offset)
        with storage_backend.open(data_file) as f:
            assert f.size == SIZE
            f.read_into(offset, out)
        assert bytes(out) == python_read(data_file, offset, n)

    def test_numpy_of_other_dtype(self, storage_backend: StorageBackend, data_file: Path) -> None:
        out = np.empty(1000, dtype=np.float32)
        with storage_backend.open(data_file) as f:
            f.read_into(8192, out)
        assert out.tobytes() == python_read(data_file, 8192, 4000)

    def test_threads(self, storage_backend: StorageBackend, data_file: Path) -> None:
        expected = data_file.read_bytes()
        errors: list[str] = []
        with storage_backend.open(data_file) as f:

            def worker(seed: int) -> None:
                rng = np.random.default_rng(seed)
                makers = list(DESTINATIONS.values())
                for i in range(40):
                    n = int(rng.integers(0, 40000))
                    off = int(rng.integers(0, SIZE - n + 1))
                    out = makers[i % len(makers)](n, off)
                    f.read_into(off, out)
                    if bytes(out) != expected[off : off + n]:
                        errors.append(f"thread {seed} read {i} [{off}, {off + n})")

            threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert not errors

    def test_read_many(self, storage_backend: StorageBackend, data_file: Path) -> None:
        expected = data_file.read_bytes()
        reqs = [(o, aligned_empty(n, 4096)) for o, n in [(70000, 9000), (0, 4096), (1, 50000)]]
        reqs.append((SIZE - 3, aligned_empty(10, 4096)))  # outside: only this one fails
        with storage_backend.open(data_file) as f:
            results = f.read_many(reqs, depth=4)
        assert [r is None for r in results] == [True, True, True, False]
        assert isinstance(results[3], StorageError)
        for (o, out), _ in zip(reqs[:3], results[:3], strict=True):
            assert out.tobytes() == expected[o : o + out.size]

    # ---- refusals ---------------------------------------------------------------------
    @pytest.mark.parametrize("bad", list(BAD_RANGES))
    def test_out_of_range_refused(
        self, storage_backend: StorageBackend, data_file: Path, bad: str
    ) -> None:
        offset, n = BAD_RANGES[bad]
        with storage_backend.open(data_file) as f, pytest.raises(StorageError):
            f.read_into(offset, aligned_empty(n, 4096))

    def test_truncated_after_open(self, storage_backend: StorageBackend, data_file: Path) -> None:
        keep = SIZE // 2
        expected = python_read(data_file, 0, 4096)
        with storage_backend.open(data_file) as f:
            try:
                os.truncate(data_file, keep)
            except OSError as exc:  # Windows refuses to truncate a mapped file: safe too
                pytest.skip(f"the OS refuses to truncate the open file: {exc}")
            for offset, n in [(keep + 100, 1000), (keep - 100, 200), (keep & ~4095, 8192)]:
                with pytest.raises(StorageError):
                    f.read_into(offset, aligned_empty(n, 4096))
            out = aligned_empty(4096, 4096)  # what is still there still reads correctly
            f.read_into(0, out)
            assert out.tobytes() == expected

    def test_missing_file_refused(self, storage_backend: StorageBackend, data_dir: Path) -> None:
        with pytest.raises(StorageError):
            storage_backend.open(data_dir / "no-such-file.bin")

    def test_directory_refused(self, storage_backend: StorageBackend, data_dir: Path) -> None:
        with pytest.raises(StorageError):
            storage_backend.open(data_dir)

    def test_read_after_close_refused(
        self, storage_backend: StorageBackend, data_file: Path
    ) -> None:
        f = storage_backend.open(data_file)
        f.close()
        f.close()  # idempotent
        with pytest.raises(StorageError):
            f.read_into(0, aligned_empty(16, 4096))

    def test_empty_file(self, storage_backend: StorageBackend, data_dir: Path) -> None:
        path = data_dir / "empty.bin"
        path.write_bytes(b"")
        with storage_backend.open(path) as f:
            assert f.size == 0
            f.read_into(0, aligned_empty(0, 4096))
            with pytest.raises(StorageError):
                f.read_into(0, aligned_empty(1, 4096))

    # ---- stats ------------------------------------------------------------------------
    def test_stats_count_bytes_and_calls(
        self, storage_backend: StorageBackend, data_file: Path
    ) -> None:
        b0, _, c0 = storage_backend.stats.snapshot()
        sizes = [(0, 4096), (5, 10), (SIZE - 100, 100), (12345, 54321)]
        with storage_backend.open(data_file) as f:
            for offset, n in sizes:
                f.read_into(offset, aligned_empty(n, 4096))
        b1, seconds, c1 = storage_backend.stats.snapshot()
        assert b1 - b0 == sum(n for _, n in sizes)
        assert c1 - c0 == len(sizes)
        assert seconds >= 0.0
