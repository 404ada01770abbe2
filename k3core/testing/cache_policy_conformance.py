"""Conformance suite for expert-cache policies (:mod:`k3core.api.cache_policy`).

A policy plugin's whole test file can be::

    from k3.testing import CachePolicyConformance
    from my_plugin import MyPolicy

    class TestMyPolicy(CachePolicyConformance):
        factory = MyPolicy          # or: policy_name = "my-policy" (resolved in the registry)

The suite drives the policy through synthetic full-recompute and incremental traces with a
strict driver (:func:`checked_replay`) and checks the contract: a victim is always resident
and never protected, the resident set never exceeds the capacity, ``None`` only when every
resident is protected, a free slot is never declined, decisions are deterministic, unknown
options are ignored, a zero capacity is refused, and the policy survives requests that were
not announced and evictions it did not choose. Every policy gets ``trace=`` (the trace being
replayed) among its options, so trace-driven policies run too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from k3core.api.cache_policy import CachePolicy
from k3core.api.errors import K3Error
from k3core.experts.trace import trace_keys
from k3core.testing.synthetic_trace import full_recompute_trace, incremental_trace, routing
from k3core.testing.threads import thread_errors_fail

N_LAYERS, N_EXPERTS, TOPK = 6, 40, 4


@functools.lru_cache(maxsize=1)
def _small_traces() -> tuple[tuple[str, np.ndarray], ...]:
    route = routing(9, N_LAYERS, N_EXPERTS, TOPK, skew=0.8, seed=7)
    out = (
        ("full-recompute", full_recompute_trace(route, 3)),
        (
            "incremental-skewed",
            incremental_trace(N_LAYERS, N_EXPERTS, TOPK, 40, prompt=3, skew=1.0, seed=3),
        ),
        (
            "incremental-sticky",
            incremental_trace(N_LAYERS, N_EXPERTS, TOPK, 40, skew=0.3, stickiness=0.5, seed=5),
        ),
    )
    for _, arr in out:
        arr.setflags(write=False)
    return out


def small_traces() -> dict[str, np.ndarray]:
    """Three small traces: full recompute, skewed incremental, sticky incremental."""
    return dict(_small_traces())


class ContractViolation(AssertionError):
    """The policy broke the cache-policy contract."""


def checked_replay(
    policy: CachePolicy,
    pairs: np.ndarray,
    capacity: int,
    *,
    topk: int = TOPK,
    inflight: int = 0,
    seed: int = 0,
    log: list[tuple[str, int, int]] | None = None,
) -> int:
    """Replay ``pairs`` through ``policy`` checking every answer; returns the hit count.

    ``inflight`` extra resident keys (chosen with ``seed``) are added to ``protected`` for
    each batch, as reads in flight would be. ``log`` collects ``(event, key, answer)``.
    """
    rng = np.random.default_rng(seed)
    keys = trace_keys(pairs).tolist()
    layers = np.asarray(pairs)[:, 0].tolist()
    resident: dict[int, None] = {}  # insertion-ordered, so draws are reproducible
    hits, prev_layer = 0, None
    i, n = 0, len(keys)
    while i < n:
        layer = layers[i]
        j = i
        while j < n and layers[j] == layer:
            j += 1
        if prev_layer is None or layer <= prev_layer:
            policy.begin_token()
        prev_layer = layer
        policy.begin_layer(layer, keys[i:j])
        for b in range(i, j, topk):
            protected: set[int] = set()
            if inflight and resident:
                pool = list(resident)
                picks = rng.choice(len(pool), size=min(inflight, len(pool)), replace=False)
                protected.update(pool[int(p)] for p in picks)
            for k in keys[b : min(b + topk, j)]:
                if k in resident:
                    hits += 1
                    policy.on_hit(k)
                    if log is not None:
                        log.append(("hit", k, 0))
                else:
                    full = len(resident) >= capacity
                    ok = policy.admit(k, protected)
                    if log is not None:
                        log.append(("admit", k, int(bool(ok))))
                    if not full and not ok:
                        raise ContractViolation(f"declined {k:#x} with a free slot")
                    if ok:
                        if full:
                            v = policy.choose_victim(protected)
                            if log is not None:
                                log.append(("victim", k, -1 if v is None else v))
                            if v is None:
                                if any(r not in protected for r in resident):
                                    raise ContractViolation(
                                        "choose_victim returned None with an evictable resident"
                                    )
                                protected.add(k)
                                continue
                            if v not in resident:
                                raise ContractViolation(f"victim {v:#x} is not resident")
                            if v in protected:
                                raise ContractViolation(f"victim {v:#x} is protected")
                            del resident[v]
                            policy.on_evict(v)
                        resident[k] = None
                        policy.on_insert(k)
                if len(resident) > capacity:
                    raise ContractViolation("more residents than slots")
                protected.add(k)
        i = j
    return hits


class CachePolicyConformance:
    """Subclass with ``factory = SomePolicy`` or ``policy_name = "registered-name"``."""

    factory: Callable[..., CachePolicy] | None = None
    policy_name: str | None = None
    options: dict[str, Any] = {}
    capacities: tuple[int, ...] = (TOPK + 1, 12, 40, 400)

    @pytest.fixture(autouse=True)
    def _thread_errors_fail(self) -> Iterator[None]:
        """An exception in a thread the plugin started fails the test (never only a warning)."""
        with thread_errors_fail():
            yield

    def make(self, capacity: int, **extra: Any) -> CachePolicy:
        """Build the policy under test; ``trace`` defaults to the small full-recompute trace."""
        factory = self.factory
        if factory is None:
            from k3core.plugins.registry import get_registry

            assert self.policy_name, "set factory or policy_name on the conformance subclass"
            factory = get_registry().resolve("cache", self.policy_name)[0].load()
        opts = {"n_layers": N_LAYERS, "n_experts": N_EXPERTS, "topk": TOPK, **self.options, **extra}
        if opts.get("trace") is None:
            opts["trace"] = small_traces()["full-recompute"]
        return factory(capacity=capacity, **opts)

    def test_contract_on_every_trace_and_size(self) -> None:
        for name, pairs in small_traces().items():
            distinct = len(np.unique(trace_keys(pairs)))
            for cap in self.capacities:
                hits = checked_replay(self.make(cap, trace=pairs), pairs, cap)
                most = len(pairs) - min(distinct, len(pairs))
                assert 0 <= hits <= most, (
                    f"trace {name}, capacity {cap}: {hits} hits, but {len(pairs)} requests of "
                    f"{distinct} distinct experts allow at most {most}")

    def test_never_evicts_a_protected_key(self) -> None:
        for pairs in small_traces().values():
            for cap in (TOPK + 1, 12, 40):
                checked_replay(self.make(cap, trace=pairs), pairs, cap, inflight=cap // 2, seed=cap)

    def test_none_when_everything_is_protected(self) -> None:
        policy = self.make(3)
        policy.begin_token()
        keys = [(1 << 20) | e for e in range(4)]
        policy.begin_layer(1, keys)
        for k in keys[:3]:
            answer = policy.admit(k, set())
            assert answer is True, f"admit({k:#x}) with a free slot answered {answer!r}, not True"
            policy.on_insert(k)
        protected = set(keys[:3])
        if policy.admit(keys[3], protected):
            victim = policy.choose_victim(protected)
            assert victim is None, (
                f"choose_victim with every resident expert protected answered {victim!r}, not None")

    def test_deterministic(self) -> None:
        for pairs in small_traces().values():
            logs: list[list[tuple[str, int, int]]] = [[], []]
            for log in logs:
                checked_replay(self.make(12, trace=pairs), pairs, 12, inflight=2, log=log)
            if logs[0] != logs[1]:
                i = next((i for i, (a, b) in enumerate(zip(*logs, strict=False)) if a != b),
                         min(len(logs[0]), len(logs[1])))
                first = logs[0][i] if i < len(logs[0]) else "the end"
                second = logs[1][i] if i < len(logs[1]) else "the end"
                raise AssertionError(
                    f"two replays of the same trace decided differently from event {i} on: "
                    f"{first} then {second} (decisions must be deterministic)")

    def test_ignores_unknown_options(self) -> None:
        self.make(8, some_option_no_policy_knows=1)

    def test_refuses_zero_capacity(self) -> None:
        with pytest.raises(K3Error):
            self.make(0)

    def test_unannounced_requests_and_foreign_evictions(self) -> None:
        pairs = small_traces()["incremental-skewed"]
        policy = self.make(6, trace=pairs)
        keys = trace_keys(pairs).tolist()[:200]
        resident: list[int] = []
        policy.begin_token()
        for n, k in enumerate(keys):
            if n % 16 == 0:
                policy.begin_layer(k >> 20, [])  # announces nothing
            if k in resident:
                policy.on_hit(k)
                continue
            if policy.admit(k, set()):
                if len(resident) >= 6:
                    v = policy.choose_victim(set())
                    assert v in resident, (
                        f"choose_victim answered {v!r}, not one of the {len(resident)} resident "
                        "experts (after requests it was not told of, and slots it did not evict)")
                    resident.remove(v)
                    policy.on_evict(v)
                resident.append(k)
                policy.on_insert(k)
            if n % 7 == 3 and resident:  # the cache drops a slot on its own (a failed read)
                policy.on_evict(resident.pop(0))
        assert isinstance(policy.describe(), str), f"describe() returned {policy.describe()!r}"
