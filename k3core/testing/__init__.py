"""Test support shipped with k3: the conformance suites and what they are built from.

Plugins import the suites from :mod:`k3.testing` (the stable name); a kernel backend's whole
test file is one subclass of ``KernelConformance`` plus one fixture. Everything the suites
read is generated here on the fly (:mod:`k3core.testing.adversarial`,
:mod:`k3core.testing.synthetic_model`, the cache fixture of
:mod:`k3core.testing.expert_cache_conformance`); only k3's own tests use the outside oracle
(:mod:`k3core.testing.fixtures`).

Under pytest, importing this package registers the suite modules for pytest's assertion
rewriting (``pytest.register_assert_rewrite``) before any of them is imported, so a suite's
bare ``assert`` reports its values from a wheel-installed k3 too; the checks that matter
also raise with their own message (what was read, where, the first differing byte).
"""

import sys as _sys

#: the modules whose bare ``assert`` statements pytest rewrites (so a failure shows the values)
_SUITE_MODULES = (
    "cache_policy_conformance", "expert_cache_conformance", "kernel_conformance",
    "storage_conformance", "storage_data", "threads",
)

if "pytest" in _sys.modules:  # under pytest: before any suite module is imported
    import pytest as _pytest

    _pytest.register_assert_rewrite(*(f"{__name__}.{m}" for m in _SUITE_MODULES
                                      if f"{__name__}.{m}" not in _sys.modules))
