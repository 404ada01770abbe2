"""The shipped storage suite (unconfigured, ``flaky`` is its inner backend), then the faults."""

from pathlib import Path

import numpy as np
import pytest
from k3_flaky import FlakyStorage

from k3.plugin import StorageError, UsageError, create
from k3.testing import StorageConformance


class TestFlakyStorage(StorageConformance):
    @pytest.fixture
    def storage_backend(self):
        return FlakyStorage()


def test_registered_and_unconfigured_by_default(monkeypatch) -> None:
    monkeypatch.delenv("K3_FLAKY_FAIL_EVERY", raising=False)
    backend = create("storage", "flaky")
    assert isinstance(backend, FlakyStorage) and backend.fail_every == 0


def test_every_nth_read_fails_with_a_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    data = np.arange(10_000, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    backend = FlakyStorage(fail_every=3)
    with backend.open(path) as f:
        results = []
        for _ in range(6):
            out = np.zeros(1000, dtype=np.uint8)
            try:
                f.read_into(100, out)
                results.append(bytes(out) == data[100:1100].tobytes())
            except StorageError as exc:
                assert "injected fault" in str(exc)
                results.append(None)
    assert results == [True, True, None, True, True, None] and backend.injected == 2


def test_bad_settings_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("K3_FLAKY_FAIL_EVERY", "often")
    with pytest.raises(UsageError, match="K3_FLAKY_FAIL_EVERY"):
        FlakyStorage()
    with pytest.raises(UsageError, match="cannot wrap itself"):
        FlakyStorage(inner="flaky")
