"""What ``K3_TEST_REQUIRE`` asks for: names whose absence fails a test instead of skipping it.

The variable is comma-separated (CI sets ``avx2,numba,direct,mmap,ray,browser``). A name is
a plugin (a kernel backend, a storage backend or a cache policy: each conformance suite
takes the names that are not another kind's) or one of :data:`EXTRAS`, which are no plugin:
``ray`` for the cluster tests, ``browser`` for the chat page's test.
"""

from __future__ import annotations

import os

#: required names that are not plugins, each read by its own tests
EXTRAS = frozenset({"ray", "browser"})


def required() -> set[str]:
    """Every name ``K3_TEST_REQUIRE`` lists."""
    return {n.strip() for n in os.environ.get("K3_TEST_REQUIRE", "").split(",") if n.strip()}


def required_plugins() -> set[str]:
    """The names that must be plugins: all but :data:`EXTRAS`."""
    return required() - EXTRAS
