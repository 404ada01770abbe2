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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``make test``'s workers (pytest-xdist, ``--dist loadgroup``): a test file
    runs whole on one worker, so its module fixtures (a synthesized model, a packed trunk)
    are built once; the cluster's files share one group, so one local Ray cluster runs at a
    time. Without xdist the mark is inert."""
    tests = Path(__file__).parent
    for item in items:
        path = Path(item.path)
        if tests not in path.parents:
            continue
        group = "ray" if path.parent.name == "cluster" else str(path.relative_to(tests))
        item.add_marker(pytest.mark.xdist_group(group))
