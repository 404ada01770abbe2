"""The conformance suites a k3 plugin proves itself with (the stable testing API).

A plugin's whole test file is one subclass of the suite for its kind::

    import pytest
    from k3.testing import KernelConformance

    class TestMine(KernelConformance):
        @pytest.fixture
        def backend(self):
            return MyBackend()

* :class:`KernelConformance`: every op bit for bit against the numpy reference, adversarial
  inputs that separate summation orders and expose a library ``exp``, whole models;
* :class:`StorageConformance`: the storage contract (``help(k3.plugin.StorageBackend)``): any
  range into any buffer, reads of tens of MiB, many threads on one open file, replaced files,
  released handles, nothing kept resident, the refusals and the stats (``storage_name =
  "mine"`` runs it through the registry);
* :class:`CachePolicyConformance`: the cache-policy contract under a strict driver;
* :class:`ExpertCacheConformance`: the real expert cache under the policy, byte for byte.

Everything the suites read is generated on the fly or ships inside k3: they run the same from
a wheel-installed k3, outside any checkout (the storage suite writes its files on a real disk:
``$K3_TEST_DISK_DIR``, else the system temp directory, and says where). A failure says what
differed; an exception in any thread fails the test. :func:`assert_same_bits` and
:func:`checked_replay` are the comparison and the strict driver the suites use.
"""

from __future__ import annotations

try:
    import pytest  # noqa: F401 - the suites are pytest classes
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError("k3.testing runs its suites under pytest, which is not installed: "
                      "pip install pytest") from None

from k3core.testing.cache_policy_conformance import (
    CachePolicyConformance,
    ContractViolation,
    checked_replay,
)
from k3core.testing.expert_cache_conformance import ExpertCacheConformance
from k3core.testing.kernel_conformance import KernelConformance, assert_same_bits
from k3core.testing.storage_conformance import StorageConformance

__all__ = [
    "CachePolicyConformance",
    "ContractViolation",
    "ExpertCacheConformance",
    "KernelConformance",
    "StorageConformance",
    "assert_same_bits",
    "checked_replay",
]
