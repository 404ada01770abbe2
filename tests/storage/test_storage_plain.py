"""The ``plain`` storage backend: whole reads or StorageError, never a short buffer."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from k3_storage import plain
from k3_storage.plain import PlainFile, PlainStorage

from k3core.api.errors import StorageError
from k3core.plugins.registry import Registry


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, bytes]:
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    p = tmp_path / "blob.bin"
    p.write_bytes(data)
    return p, data


def test_registered_through_the_entry_point() -> None:
    reg = Registry.discover()
    assert "plain" in reg.names("storage")
    backend, name, _ = reg.create("storage", "plain")
    assert name == "plain" and isinstance(backend, PlainStorage)


def test_reads_whole_ranges_into_any_buffer(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    s = PlainStorage()
    with s.open(path) as f:
        assert f.size == len(data)
        out = np.empty(1000, np.uint8)
        f.read_into(5, out)
        assert out.tobytes() == data[5:1005]
        arr = np.empty((3, 5), np.float32)
        f.read_into(7, arr)
        assert arr.tobytes() == data[7:67]
        raw = bytearray(10)
        f.read_into(len(data) - 10, memoryview(raw))
        assert bytes(raw) == data[-10:]
        f.read_into(len(data), np.empty(0, np.uint8))
    nbytes, seconds, calls = s.stats.snapshot()
    assert nbytes == 1000 + 60 + 10 and calls == 4 and seconds >= 0


def test_refusals(blob: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = blob
    f = PlainStorage().open(path)
    with pytest.raises(StorageError, match="outside the file"):
        f.read_into(len(data) - 3, np.empty(4, np.uint8))
    with pytest.raises(StorageError, match="outside the file"):
        f.read_into(-1, np.empty(1, np.uint8))
    ro = np.empty(4, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(StorageError, match="read-only"):
        f.read_into(0, ro)
    with pytest.raises(StorageError, match="not contiguous"):
        f.read_into(0, np.empty((4, 4), np.uint8)[:, 1])
    f.close()
    with pytest.raises(StorageError, match="after close"):
        f.read_into(0, np.empty(1, np.uint8))
    with pytest.raises(StorageError, match="cannot open"):
        PlainStorage().open(tmp_path / "missing")


class _Dribble(PlainFile):
    """A file whose system calls return at most 7 bytes, as a slow device may."""

    calls = 0

    def _read_once(self, fd: int, dest: memoryview, offset: int) -> int:
        _Dribble.calls += 1
        return super()._read_once(fd, dest[:7], offset)


def test_short_reads_are_retried_to_completion(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    f = _Dribble(PlainStorage(), path)
    out = np.empty(100, np.uint8)
    f.read_into(11, out)
    assert out.tobytes() == data[11:111] and _Dribble.calls == 15


def test_file_shrinking_under_a_read_is_an_error(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    f = PlainStorage().open(path)
    os.truncate(path, 50)
    with pytest.raises(StorageError, match="short read: 40 of 100 bytes at offset 10"):
        f.read_into(10, np.empty(100, np.uint8))


def test_large_reads_split_per_call(blob: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
                                    ) -> None:
    path, data = blob
    monkeypatch.setattr(plain, "MAX_CALL", 4096)
    out = np.empty(len(data), np.uint8)
    PlainStorage().open(path).read_into(0, out)
    assert out.tobytes() == data


def test_many_threads_share_one_file(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    f = PlainStorage().open(path)

    def read(i: int) -> bool:
        out = np.empty(997, np.uint8)
        off = (i * 7919) % (len(data) - 997)
        f.read_into(off, out)
        return out.tobytes() == data[off : off + 997]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, range(400)))
