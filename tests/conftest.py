"""Shared test fixtures: the outside oracle's location and a kernel backend per test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3core.testing.fixtures import fixtures_dir


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return fixtures_dir()


@pytest.fixture(scope="session")
def manifest(fixtures: Path) -> dict:
    return json.loads((fixtures / "ops" / "MANIFEST.json").read_text())


@pytest.fixture(scope="session")
def numpy_backend():
    from k3_backends.numpy_backend import NumpyBackend

    return NumpyBackend()
