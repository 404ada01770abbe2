"""Run the shipped kernel conformance suite over every registered kernel backend.

A backend that is registered but unavailable here is skipped with its reason, unless its
name is listed in ``K3_TEST_REQUIRE`` (comma-separated; CI sets ``avx2,numba``): then the
missing or unavailable backend fails the run instead of silently skipping. The ``numpy``
reference is not compared with itself.
"""

from __future__ import annotations

import pytest
from required import required_plugins

from k3core.api.kernels import KernelBackend
from k3core.plugins.registry import get_registry
from k3core.testing.kernel_conformance import KernelConformance

REFERENCE = "numpy"


def _names() -> list[str]:
    reg = get_registry()
    registered = set(reg.names("kernel"))
    # K3_TEST_REQUIRE names every kind, and extras that are no plugin (tests/support/required.py)
    other_kinds = set(reg.names("storage")) | set(reg.names("cache"))
    return sorted((registered | (required_plugins() - other_kinds)) - {REFERENCE})


def make_backend(name: str) -> KernelBackend:
    """Build ``name`` through the registry; skip (or fail, when required) if unavailable."""
    reg = get_registry()
    required = name in required_plugins()
    if name not in reg.names("kernel"):
        pytest.fail(f"kernel backend '{name}' is required by K3_TEST_REQUIRE but not registered")
    avail = reg.probe("kernel", name)
    if not avail.ok:
        msg = f"kernel backend '{name}' is unavailable: {avail.reason}"
        if required:
            pytest.fail(msg + " (required by K3_TEST_REQUIRE)")
        pytest.skip(msg)
    backend, _, _ = reg.create("kernel", name)
    return backend


@pytest.fixture(scope="module", params=_names())
def registered_backend(request: pytest.FixtureRequest) -> KernelBackend:
    return make_backend(request.param)


class TestRegisteredBackends(KernelConformance):
    @pytest.fixture
    def backend(self, registered_backend: KernelBackend) -> KernelBackend:
        return registered_backend
