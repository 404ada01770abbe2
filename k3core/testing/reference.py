"""The numpy reference kernel backend, reached through the registry.

The kernel contract's bits are the ``numpy`` backend's (``docs/kernel-contract.md``): every
suite here compares with it. It is a built-in plugin like any other, so k3core asks the
registry for the kernel backend registered as ``numpy`` rather than importing it (the
plugin boundary, ``tests/house/test_plugin_boundary.py``).
"""

from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np

from k3core.api.kernels import KernelBackend
from k3core.plugins.registry import get_registry

#: the name the reference kernel backend is registered under
REFERENCE = "numpy"


@functools.lru_cache(maxsize=1)
def reference_class() -> type[KernelBackend]:
    """The reference backend's class (to subclass: a backend wrong in one op on purpose)."""
    spec, _ = get_registry().resolve("kernel", REFERENCE)
    return cast(type[KernelBackend], spec.load())


@functools.lru_cache(maxsize=1)
def reference() -> KernelBackend:
    """One reference backend, built once (the bits every backend must produce)."""
    backend, _, _ = get_registry().create("kernel", REFERENCE)
    return cast(KernelBackend, backend)


def exp_d(x: Any) -> np.ndarray:
    """The contract's ``exp`` in float64, unrounded, as the reference computes it."""
    return cast(np.ndarray, cast(Any, reference_class()).exp_d(np.asarray(x, dtype=np.float64)))
