"""The direct (O_DIRECT) backend beyond the shared conformance suite."""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from k3core.api.errors import StorageError
from k3core.api.storage import StorageBackend, aligned_empty
from k3core.testing.disk import disk_tmpdir
from k3core.testing.storage_conformance import SIZE, StorageConformance, write_random_file

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux only")

if sys.platform.startswith("linux"):
    from k3_storage import direct
    from k3_storage.direct import (
        DIRECT_HINT,
        DirectFile,
        DirectStorage,
        direct_alignment,
        logical_block_size,
    )


class TestDirectSmallChunks(StorageConformance):
    """Chunking and bounce paths exercised at small sizes (8 KiB per syscall)."""

    @pytest.fixture
    def storage_backend(self) -> StorageBackend:
        return DirectStorage(max_chunk=8192)


@pytest.fixture
def data() -> Iterator[tuple[Path, bytes]]:
    with disk_tmpdir("k3-direct-") as d:
        path = d / "data.bin"
        yield path, write_random_file(path, SIZE, seed=1)


@pytest.fixture
def preads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Record (buffer address, file offset, length) of every O_DIRECT syscall."""
    calls: list[tuple[int, int, int]] = []
    real = DirectFile._pread

    def spy(self: DirectFile, buf: np.ndarray, offset: int) -> int:
        calls.append((buf.ctypes.data, offset, buf.size))
        return real(self, buf, offset)

    monkeypatch.setattr(DirectFile, "_pread", spy)
    return calls


def test_opened_with_o_direct(data: tuple[Path, bytes]) -> None:
    with DirectStorage().open(data[0]) as f:
        assert fcntl.fcntl(f._handle, fcntl.F_GETFL) & os.O_DIRECT
        assert f.alignment >= 4096 and f.alignment == direct_alignment(data[0])


def test_every_syscall_aligned(data: tuple[Path, bytes], preads: list[tuple[int, int, int]]) -> None:
    path, expected = data
    rng = np.random.default_rng(3)
    with DirectStorage(max_chunk=16384).open(path) as f:
        for _ in range(200):
            n = int(rng.integers(0, 60000))
            off = int(rng.integers(0, SIZE - n + 1))
            out = aligned_empty(n + 7, 4096)[int(rng.integers(0, 8)) :][:n]
            f.read_into(off, out)
            assert out.tobytes() == expected[off : off + n]
    assert preads
    for addr, off, n in preads:
        assert addr % 4096 == 0 and off % 4096 == 0 and n % 4096 == 0
        assert 0 < n <= 16384


def test_aligned_read_lands_in_place(data: tuple[Path, bytes], preads: list[tuple[int, int, int]]) -> None:
    path, expected = data
    out = aligned_empty(65536, 4096)
    with DirectStorage().open(path) as f:
        preads.clear()
        f.read_into(8192, out)
    assert preads == [(out.ctypes.data, 8192, 65536)]  # one syscall, no bounce
    assert out.tobytes() == expected[8192 : 8192 + 65536]


def test_unaligned_length_reads_body_in_place(
    data: tuple[Path, bytes], preads: list[tuple[int, int, int]]
) -> None:
    path, expected = data
    out = aligned_empty(10000, 4096)  # the fixture's non-conforming expert size case
    with DirectStorage().open(path) as f:
        preads.clear()
        f.read_into(4096, out)
    assert preads[0] == (out.ctypes.data, 4096, 8192)  # body straight into the caller's buffer
    assert len(preads) == 2 and preads[1][1:] == (12288, 4096)  # tail block via the bounce
    assert out.tobytes() == expected[4096:14096]


def test_alignment_override_and_refusals(data: tuple[Path, bytes]) -> None:
    with DirectStorage(alignment=8192).open(data[0]) as f:
        assert f.alignment == 8192
    for bad in (1000, 256):
        with pytest.raises(StorageError):
            DirectStorage(alignment=bad)


def test_logical_block_size_is_a_power_of_two(data: tuple[Path, bytes]) -> None:
    lbs = logical_block_size(data[0])
    assert lbs is None or (lbs >= 512 and lbs & (lbs - 1) == 0)
    assert logical_block_size(data[0].parent / "missing") is None


# ---- retries and failures, with the syscall wrapped -----------------------------------
def wrap_preadv(monkeypatch: pytest.MonkeyPatch, fn: Any) -> None:
    monkeypatch.setattr(direct.os, "preadv", fn)


def test_short_reads_retried(data: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS may return less than asked, even an unaligned count: keep going."""
    path, expected = data
    real = os.preadv
    f = DirectStorage().open(path)

    def short(fd: int, bufs: list[Any], offset: int) -> int:
        r = real(fd, bufs, offset)
        return min(r, 5000)  # pretend only 5000 bytes (unaligned) arrived

    wrap_preadv(monkeypatch, short)
    for off, n in [(0, SIZE), (100, 70000), (8192, 40960)]:
        out = aligned_empty(n, 4096)
        f.read_into(off, out)
        assert out.tobytes() == expected[off : off + n]
    f.close()


def test_eintr_retried(data: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    path, expected = data
    real = os.preadv
    state = {"n": 0}
    f = DirectStorage().open(path)

    def interrupted(fd: int, bufs: list[Any], offset: int) -> int:
        state["n"] += 1
        if state["n"] % 2:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(fd, bufs, offset)

    wrap_preadv(monkeypatch, interrupted)
    out = aligned_empty(20000, 4096)
    f.read_into(333, out)
    assert out.tobytes() == expected[333:20333]
    f.close()


def test_zero_byte_read_fails_naming_file_and_offset(
    data: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    f = DirectStorage().open(data[0])
    wrap_preadv(monkeypatch, lambda fd, bufs, offset: 0)
    with pytest.raises(StorageError) as ei:
        f.read_into(12288, aligned_empty(4096, 4096))
    assert str(data[0]) in ei.value.message and "offset 12288" in ei.value.message
    f.close()


def test_io_error_is_storage_error(data: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    f = DirectStorage().open(data[0])

    def eio(fd: int, bufs: list[Any], offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    wrap_preadv(monkeypatch, eio)
    with pytest.raises(StorageError, match="Input/output error"):
        f.read_into(0, aligned_empty(4096, 4096))
    f.close()


def test_einval_on_open_refused_with_fix(data: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that refuses O_DIRECT at open (tmpfs on older kernels)."""

    def refuse(path: Any, flags: int, *a: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        raise AssertionError("direct must never open without O_DIRECT")

    monkeypatch.setattr(direct.os, "open", refuse)
    with pytest.raises(StorageError) as ei:
        DirectStorage().open(data[0])
    assert ei.value.hint == DIRECT_HINT and "O_DIRECT" in ei.value.message
    avail = DirectStorage.probe_path(data[0])
    assert not avail.ok and avail.hint == DIRECT_HINT


def test_einval_on_first_read_refused_at_open(
    data: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[int] = []
    real_close = os.close
    monkeypatch.setattr(direct.os, "close", lambda fd: (closed.append(fd), real_close(fd)))

    def einval(fd: int, bufs: list[Any], offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    wrap_preadv(monkeypatch, einval)
    with pytest.raises(StorageError) as ei:
        DirectStorage().open(data[0])
    assert ei.value.hint == DIRECT_HINT
    assert len(closed) == 1  # the descriptor is not leaked


def test_probe_path(data: tuple[Path, bytes]) -> None:
    path = data[0]
    assert DirectStorage.probe_path(path).ok
    assert DirectStorage.probe_path(path.parent).ok  # a directory: one of its files is tried
    empty = path.parent / "empty-dir"
    empty.mkdir()
    assert DirectStorage.probe_path(empty).ok  # tested with a temporary file, removed again
    assert list(empty.iterdir()) == []
    missing = DirectStorage.probe_path(path.parent / "nope.bin")
    assert not missing.ok and "no such file" in missing.reason


def test_large_read_chunked(monkeypatch: pytest.MonkeyPatch, preads: list[tuple[int, int, int]]) -> None:
    with disk_tmpdir("k3-direct-big-") as d:
        path = d / "big.bin"
        expected = write_random_file(path, (3 << 20) + 12345, seed=5)
        with DirectStorage(max_chunk=1 << 20).open(path) as f:
            for off in (0, 4096, 77):
                n = len(expected) - off
                out = aligned_empty(n, 4096)
                f.read_into(off, out)
                assert out.tobytes() == expected[off:]
    assert max(n for _, _, n in preads) <= (1 << 20) + 2 * 4096


@pytest.mark.parametrize("options, words", [
    ({"alignment": 1000}, "alignment 1000 is not a power of two of at least 512"),
    ({"alignment": 256}, "alignment 256 is not a power of two of at least 512"),
    ({"max_chunk": 0}, "max_chunk must be positive, got 0"),
])
def test_bad_options_refused_when_built(options: dict[str, int], words: str) -> None:
    """Refused with a StorageError when the backend is built (a zero chunk was a bare
    ValueError at the first open)."""
    with pytest.raises(StorageError, match=words):
        DirectStorage(**options)


def test_a_fixed_alignment_is_the_backends_and_each_files(data: tuple[Path, bytes]) -> None:
    backend = DirectStorage(alignment=8192)
    with backend.open(data[0]) as f:
        assert backend.alignment == f.alignment == 8192
        out = np.empty(100, dtype=np.uint8)
        f.read_into(8191, out)
        assert out.tobytes() == data[1][8191:8291]


def test_probe_path_of_an_unlistable_directory_says_no(
    data: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory it cannot list is a no with the reason, never an exception (the path
    probe's contract)."""
    folder = data[0].parent
    real = Path.iterdir

    def refuse(self: Path) -> Iterator[Path]:
        if self == folder:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "iterdir", refuse)
    avail = DirectStorage.probe_path(folder)
    assert not avail.ok and avail.reason == f"cannot list {folder}: Permission denied"
    assert avail.hint == DIRECT_HINT
