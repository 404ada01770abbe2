"""The hook: one cache policy spec."""

from k3.plugin import CachePolicySpec, hookimpl


@hookimpl
def k3_cache_policies() -> list[CachePolicySpec]:
    return [
        CachePolicySpec(
            name="fifo",
            factory="k3_fifo.policy:FIFOPolicy",
            description="first in, first out (a worked example of a cache policy plugin)",
            priority=-100,  # never chosen by `auto`
        )
    ]
