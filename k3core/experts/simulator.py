"""Offline expert-cache simulator: replay a recorded trace under every policy at many sizes.

Routing does not depend on the cache, so one recorded run (``expert_trace.bin``) gives the
whole hit-rate-versus-size curve of every policy. This module replays a trace through the
*same* policy objects the engine uses (:mod:`k3core.api.cache_policy`), plus the exact offline
optimum, and reports what each would have read from disk.

How a trace is replayed (:func:`replay`, the one loop)
----------------------------------------------------
* A **layer visit** is a maximal run of consecutive requests of one layer; its whole key list
  is given to ``begin_layer`` first (the engine knows a layer's routing before it loads any
  expert). A visit whose layer is not after the previous visit's starts a new pass
  (``begin_token``).
* Requests are served one at a time in trace order; the requests of one visit come in batches
  of ``topk`` (one position's top-k) and the keys of the batch being served are
  ``protected``. A victim that is not resident or is protected is a contract violation and
  raises :class:`~k3core.api.errors.PluginError`.
* A hit is a request whose key was resident. A declined admission (or no evictable slot) is
  a miss whose expert is not retained.
* ``serve="visits"`` replays a visit as the engine serves it instead (docs/expert-cache.md,
  "Mechanics"): the MoE multiplies each expert once for every row of the visit that routed to
  it, so a key is walked once per visit, at its first request. ``begin_layer`` hears the
  visit's distinct keys in that order; a repeat is served by the key's one use (counted as a
  hit, as the engine counts it as reuse; the policy hears ``on_hit`` while the key is
  resident, as the engine's walk tells it); the protected batch is the engine's, up to
  ``capacity`` distinct keys. Belady is then computed over the visits' distinct keys. A
  visit of one row has no repeats, so the two modes differ only where a visit holds many
  rows: a prefill chunk, a batched step, full recompute.
* With at least as many slots as the trace has distinct keys nothing needs evicting. A
  policy is replayed at the first such size; if it reached the compulsory ceiling there, it
  never lacked a free slot, so every larger size gives the same result and is not replayed
  again (a policy must not decline a free slot; the conformance suite checks it). Belady is
  the ceiling at those sizes by definition.

``belady`` is computed separately and exactly (:func:`belady_hits`): evict the resident whose
next use is furthest; do not retain a missed key whose next use is later than every
resident's. It does not protect the current batch, as in the reference's simulator (docs/engine-behaviours.md §8), so
it is the true ceiling; policies that use future knowledge (``offline = True``, e.g. ``replay``)
are reported but never chosen as the best online policy.

Units: every ``hit_rate`` is a fraction in ``0..1`` (hits / requests); bytes are bytes; GB in
tables are decimal (1e9) like the rest of k3's reports.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3core.api.cache_policy import CachePolicy, key_expert, key_layer, make_key
from k3core.api.errors import PluginError, UsageError
from k3core.experts.sim_result import BELADY, SimResult, SimRow, plot_result
from k3core.experts.trace import TraceError, trace_keys, validate_pairs
from k3core.model.sizes import EXPERT_BYTES

DEFAULT_CACHE_GB = (8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1450)
MODEL_LAYERS, MODEL_EXPERTS, MODEL_TOPK = 92, 896, 16

PolicyFactory = Callable[..., CachePolicy]
#: how a visit is replayed: every request in turn (the reference's), or as the engine serves
#: it (each key once per visit)
SERVE_MODES = ("requests", "visits")

__all__ = [
    "BELADY",
    "DEFAULT_CACHE_GB",
    "EXPERT_BYTES",
    "SERVE_MODES",
    "ReplayCounts",
    "SimResult",
    "SimRow",
    "TraceView",
    "belady_hits",
    "guess_groups",
    "next_use",
    "plot_result",
    "policy_factories",
    "replay",
    "replay_policy",
    "simulate",
    "slots_for_gb",
]


# ---- the trace, cut into layer visits -------------------------------------------------
@dataclass(frozen=True)
class TraceView:
    """A trace as keys plus its layer visits ``(start, end, layer, starts_pass)``."""

    keys: list[int]
    visits: list[tuple[int, int, int, bool]]

    @classmethod
    def of(cls, pairs: np.ndarray) -> TraceView:
        pairs = np.asarray(pairs)
        layers = pairs[:, 0]
        cuts = np.r_[0, np.flatnonzero(np.diff(layers)) + 1, len(layers)].tolist()
        visits: list[tuple[int, int, int, bool]] = []
        prev = None
        for s, e in zip(cuts[:-1], cuts[1:], strict=True):
            layer = int(layers[s])
            visits.append((s, e, layer, prev is None or layer <= prev))
            prev = layer
        return cls(trace_keys(pairs).tolist(), visits)

    def visit_keys(self) -> np.ndarray:
        """Each visit's distinct keys in the order of their first request, visit after visit
        (what the engine walks: :func:`replay` with ``serve="visits"``)."""
        out: list[int] = []
        for start, end, _, _ in self.visits:
            out.extend(dict.fromkeys(self.keys[start:end]))
        return np.array(out, dtype=np.int64)

    def batch_starts(self, topk: int = MODEL_TOPK) -> list[bool]:
        """Per request: does it start a batch (every ``topk`` requests within a visit)?"""
        flags = [False] * len(self.keys)
        for start, end, _, _ in self.visits:
            for j in range(start, end, topk):
                flags[j] = True
        return flags


@dataclass
class ReplayCounts:
    """What one replay of a trace counted (:func:`replay`)."""

    requests: int = 0
    hits: int = 0  # resident before the request, and not placed there by a guess
    repeats: int = 0  # serve="visits": requests of a key its visit had walked (in ``hits``)
    demand_reads: int = 0  # misses the request had to read itself
    guess_reads: int = 0
    used: int = 0  # guessed reads a later request of their layer's visit used
    wasted: int = 0  # guessed reads their layer's visit did not request
    skipped: int = 0  # guesses with no slot a guess may take


def guess_groups(guesses: np.ndarray) -> list[tuple[int, int, list[int]]]:
    """``expert_guess.bin`` rows ``(request, layer, expert)`` as one ``(request, layer,
    experts)`` group per guess."""
    out: list[tuple[int, int, list[int]]] = []
    for at, layer, e in np.asarray(guesses, dtype=np.int64).reshape(-1, 3).tolist():
        if out and out[-1][0] == at and out[-1][1] == layer:
            out[-1][2].append(e)
        else:
            out.append((at, layer, [e]))
    return out


def _refuse_victim(policy: CachePolicy, victim: int, resident: set[int]) -> PluginError:
    what = "not resident" if victim not in resident else "protected"
    return PluginError(f"cache policy '{policy.name}' chose victim {victim:#x}, which is {what}")


def replay(
    policy: CachePolicy, view: TraceView, capacity: int, topk: int = MODEL_TOPK,
    guesses: np.ndarray | None = None, serve: str = "requests",
) -> ReplayCounts:
    """Drive ``policy`` through the trace with ``capacity`` slots (see the module docstring),
    and with ``guesses`` (``expert_guess.bin`` rows) the router lookahead's guessed reads
    too (:mod:`k3core.experts.lookahead_sim` says how they are placed and scored).
    ``serve``: one of :data:`SERVE_MODES` (the module docstring)."""
    by_visit = _serve_mode(serve) == "visits"
    resident: set[int] = set()
    pending: dict[int, int] = {}  # guessed key -> its layer, not yet requested
    out = ReplayCounts(requests=len(view.keys))
    keys = view.keys
    groups = guess_groups(guesses) if guesses is not None else []
    gi = 0
    last_visit: list[int] = []
    begin_token, begin_layer = policy.begin_token, policy.begin_layer
    on_hit, admit, choose = policy.on_hit, policy.admit, policy.choose_victim
    on_insert, on_evict = policy.on_insert, policy.on_evict

    def guess(layer: int, experts: list[int]) -> None:
        """Place the guessed experts that are not resident: a free slot, else a victim
        among keys neither in use (the last visit, other guesses) nor due (this layer on)."""
        keep = {r for r in resident if key_layer(r) >= layer} | set(pending) | set(last_visit)
        for e in dict.fromkeys(experts):
            k = make_key(layer, e)
            if k in resident:
                continue
            placed = False
            if len(pending) < capacity // 2:
                if len(resident) < capacity:
                    placed = True
                elif not all(r in keep for r in resident):
                    v = choose(keep)
                    if v is not None:
                        if v not in resident or v in keep:
                            raise _refuse_victim(policy, v, resident)
                        resident.remove(v)
                        on_evict(v)
                        placed = True
            if placed:
                resident.add(k)
                on_insert(k)
                keep.add(k)
                pending[k] = layer
                out.guess_reads += 1
            else:
                out.skipped += 1

    hits = used = demand = repeats = 0
    for start, end, layer, new_pass in view.visits:
        while gi < len(groups) and groups[gi][0] <= start:
            guess(groups[gi][1], groups[gi][2])
            gi += 1
        if new_pass:
            begin_token()
        begin_layer(layer, list(dict.fromkeys(keys[start:end])) if by_visit else keys[start:end])
        if pending:  # what this visit does not want of the guesses is wasted
            want = set(keys[start:end])
            for k, gl in list(pending.items()):
                if gl == layer and k in want:
                    continue
                if gl <= layer or new_pass:
                    del pending[k]
                    out.wasted += 1
        protected: set[int] = set()
        walked: set[int] = set()  # serve="visits": this visit's keys walked so far
        for j in range(start, end):
            k = keys[j]
            if not by_visit:
                if (j - start) % topk == 0:
                    protected = set()
            elif k in walked:  # served by its key's one use in this visit
                repeats += 1
                if k in resident:
                    on_hit(k)
                continue
            else:
                if len(protected) >= capacity:  # the engine's batch is full: the next one
                    protected = set()
                walked.add(k)
            if k in resident:
                if pending and pending.pop(k, None) is not None:
                    used += 1
                else:
                    hits += 1
                on_hit(k)
            else:
                demand += 1
                if admit(k, protected):
                    if len(resident) >= capacity:
                        keep = protected | set(pending) if pending else protected
                        v = choose(keep)
                        if v is None:
                            protected.add(k)
                            continue
                        if v not in resident or v in keep:
                            raise _refuse_victim(policy, v, resident)
                        resident.remove(v)
                        on_evict(v)
                    resident.add(k)
                    on_insert(k)
            protected.add(k)
        if groups:
            last_visit = keys[start:end]
    out.hits, out.used, out.demand_reads, out.repeats = hits + repeats, used, demand, repeats
    out.wasted += len(pending)
    return out


def replay_policy(
    policy: CachePolicy, view: TraceView, capacity: int, topk: int = MODEL_TOPK,
    serve: str = "requests",
) -> int:
    """:func:`replay` without guesses: the hit count."""
    return replay(policy, view, capacity, topk, serve=serve).hits


def _serve_mode(serve: str) -> str:
    if serve not in SERVE_MODES:
        raise UsageError(f"serve must be one of {', '.join(SERVE_MODES)}, got {serve!r}")
    return serve


def next_use(keys: np.ndarray) -> np.ndarray:
    """For each request, the index of the next request of the same key (``len`` if none)."""
    keys = np.asarray(keys)
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(
    keys: np.ndarray,
    capacity: int,
    nxt: np.ndarray | None = None,
    *,
    batch_starts: Sequence[bool] | None = None,
) -> int:
    """Exact Belady with bypass (the offline optimum for hit count).

    With ``batch_starts`` (a flag per request, :meth:`TraceView.batch_starts`) the keys of
    the batch being served are never evicted, the rule :func:`replay_policy` enforces; the
    victim is then the unprotected resident needed furthest away. Without it this is the
    reference's unconstrained ceiling.
    """
    nu = (next_use(keys) if nxt is None else nxt).tolist()
    kl = np.asarray(keys).tolist()
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    batch: set[int] = set()
    protect = batch_starts is not None
    for i, k in enumerate(kl):
        if protect and batch_starts[i]:  # type: ignore[index]
            batch = set()
        if k in resident:
            hits += 1
        elif len(resident) >= capacity:
            aside = []
            while heap:
                top_nu, top_key = heap[0]
                if -top_nu != resident.get(top_key):
                    heapq.heappop(heap)
                elif top_key in batch:
                    aside.append(heapq.heappop(heap))
                else:
                    break
            victim = heap[0] if heap else None
            for item in aside:
                heapq.heappush(heap, item)
            if victim is None or nu[i] > -victim[0]:
                if protect:
                    batch.add(k)
                continue  # needed later than everything evictable: do not retain
            del resident[victim[1]]  # its heap entry goes stale
        resident[k] = nu[i]
        heapq.heappush(heap, (-nu[i], k))
        if protect:
            batch.add(k)
    return hits


# ---- the simulation -----------------------------------------------------------------------
def slots_for_gb(cache_gb: float, expert_bytes: int = EXPERT_BYTES) -> int:
    """Slots a budget of ``cache_gb`` decimal GB holds (the reference's conversion)."""
    return int(cache_gb * 1e9 // expert_bytes)


def policy_factories(names: Sequence[str] | None) -> dict[str, PolicyFactory]:
    """The registered cache policies ``names`` (default: every one), by their own names."""
    from k3core.plugins.registry import get_registry

    reg = get_registry()
    chosen = names if names is not None else reg.names("cache")
    out: dict[str, PolicyFactory] = {}
    for name in chosen:
        if name == BELADY:
            continue
        spec, _ = reg.resolve("cache", name)
        out[spec.name] = spec.load()
    return out


def policy_options(pairs: np.ndarray, n_layers: int, n_experts: int, topk: int,
                   options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What every policy of a replay is made with: the shape, then ``options`` (``trace``
    is the trace replayed, so ``replay`` replays this very trace)."""
    return {"n_layers": n_layers, "n_experts": n_experts, "topk": topk, "trace": pairs,
            **(options or {})}


def checked_pairs(pairs: np.ndarray) -> np.ndarray:
    """``pairs`` as the ``(N, 2)`` native int32 array the simulator replays, or refused."""
    arr = np.asarray(pairs)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise TraceError(f"trace: expected (layer, expert) pairs as an (N, 2) array, got shape "
                         f"{arr.shape} (read a file with read_trace)")
    return validate_pairs(arr.reshape(-1), None, None)


def simulate(
    pairs: np.ndarray,
    slots_list: Sequence[int] | None = None,
    policies: Sequence[str] | Mapping[str, PolicyFactory] | None = None,
    expert_bytes: int = EXPERT_BYTES,
    requests_per_token: int | None = None,
    *,
    cache_gb: Sequence[float] | None = None,
    topk: int = MODEL_TOPK,
    n_layers: int | None = None,
    n_experts: int | None = None,
    options: Mapping[str, Any] | None = None,
    progress: Callable[[str, int], None] | None = None,
    serve: str = "requests",
) -> SimResult:
    """Replay ``pairs`` under each policy and exact Belady at each size.

    ``pairs``: the trace as an ``(N, 2)`` int array of ``(layer, expert)``
    (:func:`k3core.experts.trace.read_trace` reads a file into one).
    Sizes: ``slots_list``, or ``cache_gb`` budgets, or by default :data:`DEFAULT_CACHE_GB`
    converted with ``expert_bytes``; sizes under ``topk + 1`` slots are skipped (the engine
    refuses them). ``policies``: registry names (default: every registered cache policy) or a
    ``{name: factory}`` map. ``requests_per_token`` defaults to ``topk * n_layers``.
    ``n_layers``/``n_experts`` default to the real model's 92/896 when the trace fits them,
    else to what the trace shows. ``options`` are passed to every policy
    (:func:`policy_options`). ``serve`` is how a visit is replayed (:data:`SERVE_MODES`, the
    module docstring). Returns a :class:`SimResult`.
    """
    serve = _serve_mode(serve)
    pairs = checked_pairs(pairs)
    max_layer, max_expert = int(pairs[:, 0].max()), int(pairs[:, 1].max())
    if n_layers is None:
        n_layers = MODEL_LAYERS if max_layer <= MODEL_LAYERS else max_layer
    if n_experts is None:
        n_experts = MODEL_EXPERTS if max_expert < MODEL_EXPERTS else max_expert + 1
    if topk < 1 or expert_bytes < 1:
        raise UsageError(f"topk and expert_bytes must be positive (got {topk}, {expert_bytes})")
    per_token = int(requests_per_token or topk * n_layers)
    if per_token < 1:
        raise UsageError(f"requests per token must be positive, got {per_token}")

    if slots_list is not None and cache_gb is not None:
        raise UsageError("give cache sizes as slots or as GB, not both")
    gbs: list[float | None]
    if slots_list is not None:
        sizes, gbs = [int(s) for s in slots_list], [None] * len(slots_list)
    else:
        budget = list(cache_gb) if cache_gb is not None else list(DEFAULT_CACHE_GB)
        sizes, gbs = [slots_for_gb(g, expert_bytes) for g in budget], [float(g) for g in budget]
    if not sizes:
        raise UsageError("no cache sizes to simulate")

    if policies is None or not isinstance(policies, Mapping):
        factories = policy_factories(policies)
    else:
        factories = dict(policies)
    keys = trace_keys(pairs)
    view = TraceView.of(pairs)
    uniq, counts = np.unique(keys, return_counts=True)
    hot = np.argsort(-counts, kind="stable")[:6]
    offline = sorted(n for n, f in factories.items() if getattr(f, "offline", False))
    names = [*factories, BELADY]
    result = SimResult(
        requests=len(keys),
        distinct=len(uniq),
        tokens=max(len(keys) // per_token, 1),
        requests_per_token=per_token,
        expert_bytes=int(expert_bytes),
        n_layers=int(n_layers),
        n_experts=int(n_experts),
        hottest=[(key_layer(int(uniq[i])), key_expert(int(uniq[i])), int(counts[i])) for i in hot],
        policies=names,
        offline=offline,
        seconds={n: 0.0 for n in names},
        serve=serve,
    )
    walked = view.visit_keys() if serve == "visits" else keys  # what Belady serves
    nxt = next_use(walked)
    opts = policy_options(pairs, n_layers, n_experts, topk, options)
    n = len(keys)
    ceiling_hits = n - result.distinct
    at_ceiling: set[str] = set()  # reached the ceiling with room for every key: done
    for slots, gb in zip(sizes, gbs, strict=True):
        if slots < topk + 1:
            result.skipped_slots.append(slots)
            continue
        rates: dict[str, float] = {}
        roomy = slots >= result.distinct
        for name, factory in factories.items():
            if roomy and name in at_ceiling:
                # it never ran out of free slots at a smaller size, so with more it makes
                # the same decisions (the contract: a free slot is never declined)
                rates[name] = ceiling_hits / n
                continue
            if progress:
                progress(name, slots)
            t0 = time.perf_counter()
            policy = factory(capacity=slots, **opts)
            hits = replay(policy, view, slots, topk, serve=serve).hits
            rates[name] = hits / n
            result.seconds[name] += time.perf_counter() - t0
            if roomy and hits == ceiling_hits:
                at_ceiling.add(name)
        t0 = time.perf_counter()
        # with room for every key Belady never evicts: exactly the compulsory ceiling
        optimum = (n - len(walked) + belady_hits(walked, slots, nxt)) if not roomy else ceiling_hits
        rates[BELADY] = optimum / n
        result.seconds[BELADY] += time.perf_counter() - t0
        result.rows.append(_row(result, slots, gb, rates))
    return result


def _row(result: SimResult, slots: int, gb: float | None, rates: dict[str, float]) -> SimRow:
    online = [p for p in rates if p != BELADY and p not in result.offline]
    best = max(online, key=lambda p: (rates[p], p == "lru")) if online else BELADY
    n = result.requests

    def per_token(rate: float) -> float:
        return (1.0 - rate) * n * result.expert_bytes / result.tokens

    bpt = {best: per_token(rates[best])}
    if "lru" in rates:
        bpt["lru"] = per_token(rates["lru"])
    gap = None
    if "lru" in rates and rates[BELADY] - rates["lru"] > 1e-12:
        gap = (rates[best] - rates["lru"]) / (rates[BELADY] - rates["lru"])
    return SimRow(slots, gb, rates, best, bpt, gap)
