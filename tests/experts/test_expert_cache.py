"""The routed-expert cache under every registered policy and storage backend: exact bytes
under eviction pressure, scattered experts, batches bigger than the cache, honest metrics,
transient experts and invalid victims (the suite is ``k3core.testing.expert_cache_conformance``)."""

from __future__ import annotations

from k3core.plugins.registry import get_registry
from k3core.testing.expert_cache_conformance import ExpertCacheConformance


def test_every_registered_policy_is_covered() -> None:
    assert set(get_registry().names("cache")) <= {c.policy_name for c in ExpertCacheConformance.__subclasses__()}


class TestLRU(ExpertCacheConformance):
    policy_name = "lru"


class TestS3FIFO(ExpertCacheConformance):
    policy_name = "s3fifo"


class TestCycleETA(ExpertCacheConformance):
    policy_name = "cycle-eta"


class TestReplay(ExpertCacheConformance):
    policy_name = "replay"
