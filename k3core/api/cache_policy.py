"""The expert-cache policy contract: what a policy plugin is told and what it decides.

The routed-expert cache (``k3core.experts.cache``) owns the slots, the reads and the bytes;
a *policy* only decides **which experts stay resident**. It never sees weights, never
changes a result, and cannot make a read fail: whatever it answers, the same tokens come out,
only the number of bytes read from disk changes. The same policy object drives the offline
trace simulator (:mod:`k3core.experts.simulator`), so a policy measured there behaves identically in
a run.

Keys
----
An expert is named by one ``int``: ``key = layer << 20 | expert`` (:func:`make_key`,
:func:`key_layer`, :func:`key_expert`). Layers are the model's one-based MoE layer numbers,
experts are ``0 .. n_experts-1`` (``n_experts`` < 2**20).

Construction
------------
A policy is built by its plugin factory with keyword arguments only::

    policy = Factory(capacity=C, n_layers=92, n_experts=896, **options)

``capacity`` is the number of slots (>= 1). ``n_layers``/``n_experts`` bound the keys and let a
policy size per-key tables; ``topk`` (experts per position, 16 for the real model) is passed
by the cache and the simulator too. Further options are policy specific (``trace=`` for ``replay``: a
path to an ``expert_trace.bin`` or an ``(N, 2)`` int array); a policy must accept and ignore
options it does not know, so a caller can pass one option set to any policy. A bad option is a
:class:`~k3core.api.errors.PluginError` or :class:`~k3core.api.errors.UsageError` (exit 2).

Events, in the order the cache issues them
-----------------------------------------
``begin_token()``
    A new forward pass starts (one generated token; in full-recompute decode one pass over the
    whole prefix; the prompt's prefill pass counts as one). Every pass visits the MoE layers in
    the same fixed order.
``begin_layer(layer, keys)``
    One visit of ``layer`` starts. ``keys`` is every request this visit will make, in request
    order: the router has run for all positions of the pass before the first expert is
    loaded, so this look-ahead is knowledge the engine really has (16 keys per position;
    ``16 * T`` when ``T`` positions are batched through the layer). The engine's cache serves
    each key once per visit (one use multiplies every row routed to it), so it announces each
    key once, in the order of its first request; the offline simulator's ``requests`` replay
    (the reference's) announces the duplicates too, each a request of its own. A policy may
    use it; it may not assume anything about later layers or later passes.
``on_hit(key)``
    ``key`` was requested and is resident (or already being read for an earlier request). The
    engine's cache also reports a key's later requests in the same visit this way while the
    key is resident: the rows its one use served (they never miss).
``admit(key, protected) -> bool``
    ``key`` was requested and is not resident: this is the policy's miss notification, issued
    exactly once per missed request, before any victim is chosen. Return ``True`` to keep the
    expert in a slot, ``False`` to serve it from a transient buffer that is dropped after use
    (the request still succeeds; the expert is simply not retained). A policy must admit while
    the cache has a free slot (it knows: it sees every insert and evict); the simulator relies
    on it to skip replays at sizes that hold every key.
``choose_victim(protected) -> key | None``
    Called only after ``admit`` returned ``True`` and every slot is taken. Return a resident key
    to evict. It must not be in ``protected`` (keys of the batch being served and keys whose
    read is in flight: the MoE still holds pointers into those slots). ``None`` means every
    resident key is protected; the cache then serves the request transiently (or waits for an
    in-flight read), exactly as if ``admit`` had declined.
``on_evict(key)`` then ``on_insert(key)``
    The cache evicted ``key`` / placed ``key`` in a slot. Only these two calls change the
    resident set, so a policy tracks residency itself and never scans the cache. A
    ``choose_victim`` answer is always followed by ``on_evict`` of that key before any other
    event.

``protected`` is a read-only container the cache owns (a ``set``); test membership only.

Driving a policy from a real cache
----------------------------------
A policy is not thread-safe: call it under the cache's lock, from the serial reserve phase
of a batch (``get_many``), never from the parallel read workers. For one layer's batch:
``begin_layer`` once per visit (all of the visit's keys; calling it again for the same layer
before the next ``begin_token`` adds keys to the same visit), then for each requested key in
order: resident or already in flight -> ``on_hit``; otherwise ``admit``; if admitted and no
slot is free -> ``choose_victim`` (the victim's slot becomes INFLIGHT for the new key) ->
``on_evict(victim)``; then ``on_insert(key)`` when the slot is reserved. ``protected`` holds
the batch's keys and every key in flight. A read that fails or comes back short leaves its
slot EMPTY: report it with ``on_evict(key)``. A prefetch (an expert read without a request)
may be placed with ``on_insert`` alone, into a free slot or after ``choose_victim``; it is
not a request and is not announced.

Cost
----
The real model makes 1,472 requests per token (92 layers x top-16) and the simulator replays
hundreds of thousands, so every event should be O(1) or O(log n) amortised. ``begin_layer`` may
cost O(len(keys) + resident keys of that layer). Never scan all residents per request.

Determinism
-----------
Given the same constructor arguments and the same event sequence a policy must make the same
decisions (no wall clock, no unseeded randomness, no iteration over hash-ordered sets that
leaks into a decision). The conformance suite
(:class:`k3core.testing.cache_policy_conformance.CachePolicyConformance`) checks this, the
protected rule and the capacity bound for every registered policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence
from typing import Any

KEY_SHIFT = 20
EXPERT_MASK = (1 << KEY_SHIFT) - 1


def make_key(layer: int, expert: int) -> int:
    """The cache key of ``expert`` of ``layer``."""
    return (int(layer) << KEY_SHIFT) | int(expert)


def key_layer(key: int) -> int:
    """The layer a key belongs to."""
    return key >> KEY_SHIFT


def key_expert(key: int) -> int:
    """The expert index within its layer."""
    return key & EXPERT_MASK


class CachePolicy(ABC):
    """Base class of expert-cache policies (see the module docstring for the contract).

    Subclasses implement :meth:`admit`, :meth:`choose_victim`, :meth:`on_insert` and
    :meth:`on_evict` at least; the remaining hooks default to doing nothing.
    """

    #: short name shown in reports (the registry name is authoritative)
    name: str = "policy"
    #: True for a policy that uses a recording of the future (``replay``): the simulator
    #: reports it as a ceiling and never picks it as the best online policy
    offline: bool = False

    def __init__(self, capacity: int, *, n_layers: int = 92, n_experts: int = 896, **options: Any):
        if int(capacity) < 1:
            from k3core.api.errors import UsageError

            raise UsageError(f"a cache policy needs at least one slot, got capacity {capacity}")
        self.capacity = int(capacity)
        self.n_layers = int(n_layers)
        self.n_experts = int(n_experts)

    def begin_token(self) -> None:  # noqa: B027 - optional hook
        """A new forward pass starts."""

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:  # noqa: B027
        """A visit of ``layer`` starts; ``keys`` are all of its requests, in order."""

    def on_hit(self, key: int) -> None:  # noqa: B027
        """``key`` was requested and is resident."""

    @abstractmethod
    def admit(self, key: int, protected: Container[int]) -> bool:
        """``key`` missed: keep it (``True``) or serve it transiently (``False``)."""

    @abstractmethod
    def choose_victim(self, protected: Container[int]) -> int | None:
        """A resident key not in ``protected`` to evict, or ``None`` if there is none."""

    @abstractmethod
    def on_insert(self, key: int) -> None:
        """``key`` now occupies a slot."""

    @abstractmethod
    def on_evict(self, key: int) -> None:
        """``key`` no longer occupies a slot."""

    def describe(self) -> str:
        """One line for the run report (policy state worth showing)."""
        return self.name
