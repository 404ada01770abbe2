"""``replay``: Belady's decisions from a trace recorded by an earlier run of the same request.

Routing does not depend on the cache, so a second run of the same request asks for the same
experts in the same order. Given that run's ``expert_trace.bin`` (``--dump-cache-trace``),
this policy knows every next use and applies Belady's rule with bypass: evict the resident
whose next use is furthest away, and do not retain a missed expert whose next use is later
than every resident's (ties admit). On a repeated request it reaches the offline ceiling.

Following the live run (correctness never depends on the trace)
---------------------------------------------------------------
A cursor points at the trace request the run is expected to make next.

* A request equal to the trace at the cursor advances it (in sync).
* Otherwise the policy looks for the key's next occurrence within ``window`` requests after
  the cursor (default 4,096, about three incremental tokens); if found it *resynchronises*:
  the skipped trace requests are treated as not made (their keys' next uses are recomputed)
  and the cursor moves past the occurrence.
* A request not found in the window is *unsynced*: the cursor stays, and the key's next use
  is its next occurrence in the trace if any (else never).
* A health score (an exponential average over ``sync_window`` requests, default 1,472 = one
  token of the real model; 1 = in sync) decides the mode: while it is at least ``min_sync`` (default 0.5) victims follow Belady;
  below it the policy falls back to plain LRU (admit everything, evict least recent), and it
  returns to Belady as soon as the run is back in step with the trace.

A layer visit of many rows (a prefill chunk, a batched step) repeats keys. The engine's cache
serves each key once per visit and announces it once (``begin_layer``): there a key's next
use is its first request in a later visit of its layer, not a repeat in this one. A visit
announced with repeats (the simulator's request-by-request replay, the reference's) keeps
the next request, repeats included.

The policy only decides residency, so a trace from a different prompt, a truncated trace or
a trace of another model costs hits, never correctness. Keys outside the trace simply have
no known next use.

Cost: O(log C) per event in sync (a max-heap of next-use indices with lazy invalidation), plus
O(skipped requests) for a resync and O(log occurrences) per unsynced lookup. Memory: about
100 bytes per traced request (the trace, its next-use index and each key's occurrences as
Python lists), e.g. ~150 MB for a 1,000-token run of the full model.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Container, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from k3_caches.lazy_heap import top_unprotected

from k3.plugin import KEY_SHIFT, CachePolicy, PluginError, next_use, read_trace, trace_keys


def _load_keys(trace: Any, n_layers: int, n_experts: int) -> np.ndarray:
    if trace is None:
        raise PluginError(
            "cache policy 'replay' needs a trace recorded by an earlier run of the same "
            "request (an expert_trace.bin from --dump-cache-trace)"
        )
    if isinstance(trace, (str, Path)):
        pairs = read_trace(trace, n_layers=n_layers, n_experts=n_experts)
    else:
        pairs = np.asarray(trace)
        if pairs.ndim != 2 or pairs.shape[1] != 2 or not np.issubdtype(pairs.dtype, np.integer):
            raise PluginError(
                f"cache policy 'replay': trace must be an (N, 2) integer array, "
                f"got shape {pairs.shape} of {pairs.dtype}"
            )
    return trace_keys(pairs)


class ReplayPolicy(CachePolicy):
    """Belady with bypass driven by a recorded trace; LRU while out of step with it."""

    name = "replay"
    offline = True  # uses a recording of the future: a ceiling, not an online policy

    def __init__(
        self,
        capacity: int,
        *,
        trace: Any = None,
        window: int = 4096,
        min_sync: float = 0.5,
        sync_window: int = 1472,
        **options: Any,
    ):
        super().__init__(capacity, **options)
        keys = _load_keys(trace, self.n_layers, self.n_experts)
        self._tkeys: list[int] = keys.tolist()
        self._n = len(self._tkeys)
        self._inf = self._n  # "never used again" (larger than any index)
        self._nxt: list[int] = next_use(keys).tolist()  # next index of the same key
        # per trace request, the end of its layer visit (a run of one layer's requests)
        cuts = np.flatnonzero(np.diff(keys >> KEY_SHIFT)) + 1
        bounds = np.r_[0, cuts, len(keys)]
        self._vend: list[int] = np.repeat(bounds[1:], np.diff(bounds)).tolist()
        self._once = False  # the current visit announced each key once (the engine's cache)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        cut = np.flatnonzero(np.diff(sorted_keys)) + 1
        self._occ: dict[int, list[int]] = {
            int(group_keys[0]): idx.tolist()
            for group_keys, idx in zip(
                np.split(sorted_keys, cut), np.split(order, cut), strict=True
            )
            if len(group_keys)
        }
        self.window = max(int(window), 0)
        self.min_sync = float(min_sync)
        self._cursor = 0
        self._health = 1.0
        self._rate = 1.0 / max(int(sync_window), 1)
        self._nu: dict[int, int] = {}  # resident -> next use index
        self._heap: list[tuple[int, int, int]] = []  # (-next_use, seq, key)
        self._heap_live = False  # built at the first victim search
        self._seq = 0
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pending: tuple[int, int] | None = None
        self.synced = 0
        self.resyncs = 0
        self.unsynced = 0

    # ---- following the trace --------------------------------------------------------
    def _next_after(self, key: int, index: int) -> int:
        """The first occurrence of ``key`` strictly after trace index ``index``."""
        occ = self._occ.get(key)
        if not occ:
            return self._inf
        j = bisect_right(occ, index)
        return occ[j] if j < len(occ) else self._inf

    def _locate(self, key: int) -> int:
        """Match one live request against the trace; returns the key's next use index."""
        c = self._cursor
        if c < self._n and self._tkeys[c] == key:
            self._cursor = c + 1
            self.synced += 1
            self._health += (1.0 - self._health) * self._rate
            return self._next_after(key, self._vend[c] - 1) if self._once else self._nxt[c]
        occ = self._occ.get(key)
        j = bisect_left(occ, c) if occ else 0
        if occ and j < len(occ) and occ[j] - c <= self.window:
            pos = occ[j]
            after = self._vend[pos] - 1 if self._once else pos  # its next use comes after
            for i in range(c, pos):  # skipped trace requests: refresh their next uses
                skipped = self._tkeys[i]
                if skipped in self._nu and skipped != key:
                    self._set_nu(skipped, self._next_after(skipped, after))
            self._cursor = pos + 1
            self.resyncs += 1
            self._health += (1.0 - self._health) * self._rate
            return self._next_after(key, after)
        self.unsynced += 1
        self._health -= self._health * self._rate
        return occ[j] if occ and j < len(occ) else self._inf

    @property
    def in_sync(self) -> bool:
        return self._health >= self.min_sync

    # ---- heap --------------------------------------------------------------------------
    def _set_nu(self, key: int, nu: int) -> None:
        self._nu[key] = nu
        if self._heap_live:
            self._seq += 1
            heapq.heappush(self._heap, (-nu, self._seq, key))
            if len(self._heap) > 4 * self.capacity + 64:
                self._build_heap()

    def _build_heap(self) -> None:
        base, self._seq = self._seq, self._seq + len(self._nu)
        self._heap = [(-v, base + i + 1, k) for i, (k, v) in enumerate(self._nu.items())]
        heapq.heapify(self._heap)
        self._heap_live = True

    def _belady_victim(self, protected: Container[int]) -> int | None:
        if not self._heap_live:
            self._build_heap()
        return top_unprotected(self._heap, lambda e: self._nu.get(e[2]) == -e[0], protected)

    def _lru_victim(self, protected: Container[int]) -> int | None:
        for key in self._lru:
            if key not in protected:
                return key
        return None

    # ---- events ------------------------------------------------------------------------
    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        self._once = len(set(keys)) == len(keys)

    def on_hit(self, key: int) -> None:
        nu = self._locate(key)
        if key in self._nu:
            self._set_nu(key, nu)
            self._lru.move_to_end(key)

    def admit(self, key: int, protected: Container[int]) -> bool:
        nu = self._locate(key)
        self._pending = (key, nu)
        if len(self._nu) < self.capacity or not self.in_sync:
            return True
        victim = self._belady_victim(protected)
        return victim is not None and nu <= self._nu[victim]

    def choose_victim(self, protected: Container[int]) -> int | None:
        if self.in_sync:
            return self._belady_victim(protected)
        return self._lru_victim(protected)

    def on_insert(self, key: int) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            nu = pending[1]
        else:  # inserted without a request (a prefetch)
            nu = self._next_after(key, self._cursor - 1)
        self._set_nu(key, nu)
        self._lru[key] = None

    def on_evict(self, key: int) -> None:
        del self._nu[key]
        del self._lru[key]

    def describe(self) -> str:
        mode = "Belady from trace" if self.in_sync else "LRU fallback (out of step with the trace)"
        return (
            f"replay: {mode}; {self.synced} in step, {self.resyncs} resyncs, "
            f"{self.unsynced} unmatched requests"
        )
