"""The routed-expert cache under every registered policy and storage backend: exact bytes
under eviction pressure, scattered experts, batches bigger than the cache, honest metrics,
transient experts and invalid victims (the suite is ``k3core.testing.expert_cache_conformance``).

The policies come from the registry, built-in or installed: no list is kept by hand, so an
installed third-party policy is tested too and never breaks this file.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from k3core.plugins.registry import get_registry
from k3core.testing.expert_cache_conformance import ExpertCacheConformance

REGISTERED = get_registry().names("cache")


def _class_name(policy: str) -> str:
    return "TestPolicy_" + re.sub(r"\W", "_", policy)


def _runnable(policy: str) -> Any:
    """An autouse fixture: skip (with the registry's reason) a policy that cannot run here."""
    @pytest.fixture(autouse=True)
    def runnable(self: Any) -> None:
        reg = get_registry()
        if policy not in reg.available("cache"):
            pytest.skip(f"cache policy '{policy}' cannot run here: {reg.probe('cache', policy).reason}")
    return runnable


for _name in REGISTERED:
    globals()[_class_name(_name)] = type(_class_name(_name), (ExpertCacheConformance,),
                                         {"policy_name": _name, "__module__": __name__,
                                          "_runnable": _runnable(_name)})


def test_every_registered_policy_is_covered() -> None:
    covered = {c.policy_name for c in ExpertCacheConformance.__subclasses__()
               if c.__module__ == __name__}
    assert covered == set(get_registry().names("cache"))
    assert {"cycle-eta", "lru", "replay", "s3fifo"} <= covered
