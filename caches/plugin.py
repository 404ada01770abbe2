"""The built-in cache policies' registration (entry point ``caches`` of the ``k3`` group).

Only spec records live here; each policy module is imported when its name is resolved.
``auto`` picks the highest priority: ``cycle-eta``.
"""

from __future__ import annotations

from k3.plugin import CachePolicySpec, hookimpl


@hookimpl
def k3_cache_policies() -> list[CachePolicySpec]:
    return [
        CachePolicySpec(
            name="cycle-eta",
            factory="k3_caches.cycle_eta:CycleETAPolicy",
            description="evict the expert expected back furthest away, in layer cycles "
            "(online Belady approximation; frequency-like when reuse is rare)",
            priority=30,
        ),
        CachePolicySpec(
            name="lru",
            factory="k3_caches.lru:LRUPolicy",
            description="least recently used (the reference engine's original policy; baseline)",
            priority=10,
        ),
        CachePolicySpec(
            name="s3fifo",
            factory="k3_caches.s3fifo:S3FIFOPolicy",
            description="S3-FIFO as the reference runs it (10 % small, ghost, frequency cap 3)",
            priority=5,
        ),
        CachePolicySpec(
            name="replay",
            factory="k3_caches.replay:ReplayPolicy",
            description="Belady's decisions from a trace of an earlier run of the same request "
            "(needs trace=expert_trace.bin; LRU while out of step with it)",
            priority=0,
        ),
    ]
