"""The shipped suites, run through the registry (so the registration is tested too)."""

from k3.testing import CachePolicyConformance, ExpertCacheConformance


class TestFIFOPolicy(CachePolicyConformance):
    policy_name = "fifo"


class TestFIFOInTheCache(ExpertCacheConformance):
    policy_name = "fifo"
