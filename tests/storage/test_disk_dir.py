"""Where the storage tests write: ``$K3_TEST_DISK_DIR`` when set (created, never a memory
filesystem), else the system temp directory when it is a disk; and a line that says which."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3core.api.errors import UsageError
from k3core.testing.disk import (
    describe_scratch_root,
    disk_scratch_root,
    disk_tmpdir,
    is_memory_fs,
)


def test_the_variable_names_the_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if is_memory_fs(tmp_path):
        pytest.skip("the temp directory is a memory filesystem here")
    chosen = tmp_path / "disk" / "k3"
    monkeypatch.setenv("K3_TEST_DISK_DIR", str(chosen))
    assert disk_scratch_root() == chosen and chosen.is_dir()
    assert describe_scratch_root().startswith(f"{chosen}")
    assert describe_scratch_root().endswith(": from $K3_TEST_DISK_DIR")
    with disk_tmpdir("k3-where-") as d:
        assert d.parent == chosen
    assert not d.exists()


def test_a_memory_filesystem_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and is_memory_fs(shm)):
        pytest.skip("no memory filesystem at /dev/shm here")
    monkeypatch.setenv("K3_TEST_DISK_DIR", str(shm / "k3-not-a-disk"))
    with pytest.raises(UsageError, match=r"K3_TEST_DISK_DIR=/dev/shm/k3-not-a-disk is on a "
                                         r"memory filesystem \(tmpfs\), not a disk"):
        disk_scratch_root()


def test_unset_the_temp_directory_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("K3_TEST_DISK_DIR", raising=False)
    line = describe_scratch_root()
    if is_memory_fs(disk_scratch_root().parent):
        pytest.skip("the temp directory is a memory filesystem here")
    assert "the system temp directory; set $K3_TEST_DISK_DIR to test another disk" in line
