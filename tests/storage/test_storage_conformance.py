"""Run the storage conformance suite over every registered storage backend.

An unavailable backend is skipped with its probe's reason, except that a name listed in
``K3_TEST_REQUIRE`` (comma-separated) must be available: there a skip becomes a failure.
"""

from __future__ import annotations

import pytest
from required import required_plugins

from k3core.api.storage import StorageBackend
from k3core.plugins.registry import get_registry
from k3core.testing.storage_conformance import StorageConformance

_REG = get_registry()
# K3_TEST_REQUIRE names every kind and extras that are no plugin (tests/support/required.py):
# a required plugin name that is no kernel backend or cache policy must be a registered
# storage backend (else make_backend fails rather than skipping it)
NAMES = sorted(set(_REG.names("storage"))
               | (required_plugins() - set(_REG.names("kernel")) - set(_REG.names("cache"))))


def make_backend(name: str) -> StorageBackend:
    reg = get_registry()
    if name not in reg.names("storage"):
        pytest.fail(f"storage backend '{name}' is required (K3_TEST_REQUIRE) but not registered")
    avail = reg.probe("storage", name)
    if not avail.ok:
        if name in required_plugins():
            pytest.fail(f"storage backend '{name}' is required (K3_TEST_REQUIRE) but: {avail.reason}")
        pytest.skip(f"storage backend '{name}' unavailable: {avail.reason}")
    backend, resolved, _ = reg.create("storage", name)
    assert resolved == name
    assert isinstance(backend, StorageBackend)
    return backend


class TestRegisteredStorage(StorageConformance):
    @pytest.fixture(params=NAMES)
    def storage_backend(self, request: pytest.FixtureRequest) -> StorageBackend:
        return make_backend(request.param)


def test_builtins_registered() -> None:
    assert {"mmap", "direct", "unbuffered"} <= set(NAMES)


def test_priorities() -> None:
    reg = get_registry()
    prio = {n: reg.entries["storage"][n].spec.priority for n in ("mmap", "direct", "unbuffered")}
    assert prio == {"mmap": 10, "direct": 20, "unbuffered": 30}
