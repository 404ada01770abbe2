"""FIFO, random eviction and evict-the-newest pass the shipped policy and cache suites: the
suites test the policy contract, not any one policy's hit counts."""

from __future__ import annotations

from textbook_policies import EvictNewestPolicy, FIFOPolicy, RandomPolicy

from k3.testing import CachePolicyConformance, ExpertCacheConformance


class TestFIFOPolicy(CachePolicyConformance):
    factory = FIFOPolicy


class TestRandomPolicy(CachePolicyConformance):
    factory = RandomPolicy


class TestEvictNewestPolicy(CachePolicyConformance):
    factory = EvictNewestPolicy


class TestFIFOInTheCache(ExpertCacheConformance):
    factory = FIFOPolicy


class TestRandomInTheCache(ExpertCacheConformance):
    factory = RandomPolicy


class TestEvictNewestInTheCache(ExpertCacheConformance):
    factory = EvictNewestPolicy
