"""``cycle-eta``: evict the expert whose next use is expected furthest away, in layer cycles.

Why this shape
--------------
Every forward pass visits the MoE layers in one fixed order, so an expert can only be
requested when its layer comes round: once per pass. Its next use is therefore a whole
number of cycles after its layer's last visit, and Belady's rule (evict the key needed
furthest in the future; do not admit a key needed later than every resident) can be
approximated online by *predicting* that number::

    ETA(key) = tick of its layer's last visit + P * C(class, age)

A tick is one layer visit; ``P`` is the ticks per pass (92 for the full model, measured
between ``begin_token`` calls); ``age`` is how many visits of its layer the key has missed
since it was last requested; ``class`` is ``floor(log2(requests so far))`` capped at 5
(1, 2-3, 4-7, ... 32+); and ``C(class, age)`` is the expected number of passes the key
occupies a slot per hit it yields, from a hazard table learnt from the run itself (below).
The victim is the resident with the largest ETA; a missed key is admitted only if its ETA is
smaller than the victim's. One rule covers the regimes the engine meets:

* reuse near certain (full-recompute decode re-runs the prefix, so every expert seen comes
  back every pass; ``C`` -> 1): keys are ordered by *phase*: the resident whose layer was
  served most recently is needed last, and a newly missed key is needed no sooner than any
  resident, so it is declined instead of evicting one needed sooner. The resident set stays
  stable across the cycle instead of being flushed just before each layer comes round,
  which is what sinks LRU (0 cross-pass hits below one pass's working set);
* temporal locality (incremental decode where consecutive tokens share experts): the hazard
  at age 0 is high and falls with age, so recently used experts rank first, like LRU;
* independent requests with skewed popularity: the frequency classes separate hot experts
  from cold ones, like LFU (for a constant hazard ``p``, ``C = 1/p``).

The hazard table (what the run has seen, nothing from the future)
------------------------------------------------------------------
At every visit of a layer, each expert of that layer ever requested is one *opportunity*
at its current ``(class, age)``; it is a *hit* of that cell if the visit requests it. Ages
``0..max_age-1`` are kept apart and older ones lumped at ``max_age``; counts are multiplied
by ``1 - 1/horizon`` at every pass so the table follows drifting routing. The hazard
``h(c, a)`` is the cell's hit ratio shrunk toward the all-class ratio at that age, which is
shrunk toward a prior built from the all-class ratio one age younger (pseudo-count
``shrink`` at each level; Beta(1, 1) at the root), so a sparse cell never looks like a coin
flip. That prior carries the *shape* of the hazard over ages measured between the positions
of the first pass (the prompt's prefill, ``topk`` requests per position): how often an
expert used at one position returns 1, 2, ... positions later. A run thus prefers recently
used experts from its first decoded token instead of waiting passes for evidence at every
age; in full-recompute decode no key ever ages, so the shape never matters there.

``C(c, a)`` is the occupancy per hit of the best holding horizon: holding a key for at most
``m`` more visits costs ``sum_{j<m} S_j`` visits of a slot (``S_j`` = P(no request in the
first ``j``)) and yields a hit with probability ``1 - S_m``; ``C`` is the minimum ratio
over ``m`` up to the lumped age, and over holding for ever (the mean wait, with a geometric
tail). Taking the best horizon rather than the mean wait is what lets a freshly used expert
with a 30 % chance of coming straight back outrank an old one with a steady 5 %: a cache
can always drop the fresh one a pass later if it does not return. This is the hit density
of LHD (Beckmann et al., NSDI 2018) measured in layer cycles; for a constant hazard both
are ``1/p``.

Defaults (``max_age`` 16 passes, ``horizon`` 32 passes, ``shrink`` 8 pseudo-observations;
``topk`` 16, the model's) are resolution and memory choices, not fits: the hit counts on the
shipped trace do not change across max_age 8..32, horizon 16..128 and shrink 2..32. The table is rebuilt
at each ``begin_token``; a resident's ETA is refreshed at each visit of its layer.

Look-ahead the engine really has
--------------------------------
``begin_layer`` receives all of the layer's requests (the router runs before any expert is
loaded). A key with further requests in this visit has ``ETA = now``: it is admitted even
into a full cache and is the last to go, so repeats within a batch of positions still hit.
After its last request in the visit its ETA returns to the prediction.

Cost
----
``begin_layer`` is O(n_experts) in numpy (per-layer arrays of last-request visit and request
count feed the hazard counts) plus O(distinct keys + residents of that layer) in Python;
other events are O(log C): a max-heap on ETA with lazy invalidation, rebuilt when it holds
more than four entries per slot. ``begin_token`` costs O(max_age**2) for the table.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Sequence
from typing import Any

import numpy as np
from k3_caches.lazy_heap import top_unprotected

from k3.plugin import EXPERT_MASK, KEY_SHIFT, CachePolicy, UsageError, key_layer

N_CLASSES = 6  # floor(log2(requests)) buckets: 1, 2-3, 4-7, 8-15, 16-31, 32+
_CLASS_OF = np.minimum(np.floor(np.log2(np.maximum(np.arange(33), 1))), N_CLASSES - 1)
_CLASS_OF = _CLASS_OF.astype(np.int64)
_CLASS_LIST: list[int] = _CLASS_OF.tolist()


class CycleETAPolicy(CachePolicy):
    """Predicted-next-use eviction in layer cycles (see the module docstring)."""

    name = "cycle-eta"

    def __init__(
        self,
        capacity: int,
        *,
        horizon: int = 32,
        max_age: int = 16,
        shrink: float = 8.0,
        topk: int = 16,
        **options: Any,
    ):
        super().__init__(capacity, **options)
        if int(horizon) < 2 or int(max_age) < 1 or not float(shrink) > 0:
            raise UsageError(
                f"cycle-eta needs horizon >= 2, max_age >= 1 and shrink > 0 "
                f"(got horizon={horizon}, max_age={max_age}, shrink={shrink})"
            )
        self.horizon = int(horizon)
        self.max_age = int(max_age)
        cells = N_CLASSES * (self.max_age + 1)
        self.shrink = float(shrink)
        self.topk = max(int(topk), 1)
        self._opp = np.zeros(cells)
        self._hits = np.zeros(cells)
        # the same statistics between the positions of the first pass (the prompt), by age
        self._pos_opp = np.zeros(self.max_age + 1)
        self._pos_hits = np.zeros(self.max_age + 1)
        self._passes = 0
        self._C: list[list[float]] = []
        self._Carr = np.zeros((N_CLASSES, self.max_age + 1))
        self._rebuild()
        self._period = float(max(self.n_layers, 1))  # ticks per pass, measured
        self._tick = 0
        self._ticks_this_pass = 0
        # per layer: visits so far, tick of the last visit, and per-expert arrays
        self._visits: dict[int, int] = {}
        self._vtick: dict[int, int] = {}
        self._lv: dict[int, np.ndarray] = {}  # visit of the last request, -1 never
        self._cnt: dict[int, np.ndarray] = {}  # requests so far (one per visit)
        self._klv: dict[int, int] = {}  # the same two facts per key, for scalar reads
        self._kcnt: dict[int, int] = {}
        self._res_layer: dict[int, dict[int, None]] = {}  # insertion-ordered sets
        # the current visit: its layer and the requests still to come
        self._layer = -1
        self._remaining: dict[int, int] = {}
        # residents: ETA, version, lazy max-heap of (-eta, version, key)
        self._eta: dict[int, float] = {}
        self._ver: dict[int, int] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._heap_live = False  # built at the first victim search (never, if nothing evicts)
        self._seq = 0
        self._pending: tuple[int, float] | None = None  # (key, ETA) between admit and insert

    # ---- the hazard model ------------------------------------------------------------
    def hazard(self) -> np.ndarray:
        """The hazard table ``[class, age]``: P(requested at this visit | class, age).

        Evidence is pooled hierarchically so a sparse cell never looks like a coin flip: the
        all-class hazard at age 0 starts from Beta(1, 1); the all-class hazard at age ``a``
        is shrunk toward the one at ``a - 1``; each class's cell is shrunk toward the
        all-class hazard of its age (pseudo-count weight ``shrink`` at both levels).
        """
        shape = (N_CLASSES, self.max_age + 1)
        hits, opp = self._hits.reshape(shape), self._opp.reshape(shape)
        all_hits, all_opp = hits.sum(axis=0), opp.sum(axis=0)
        k = self.shrink
        shape = np.empty(self.max_age + 1)  # hazard between prompt positions, by age
        shape[0] = (self._pos_hits[0] + 1.0) / (self._pos_opp[0] + 2.0)
        for a in range(1, self.max_age + 1):
            shape[a] = (self._pos_hits[a] + k * shape[a - 1]) / (self._pos_opp[a] + k)
        pooled = np.empty(self.max_age + 1)
        pooled[0] = (all_hits[0] + 1.0) / (all_opp[0] + 2.0)
        for a in range(1, self.max_age + 1):
            prior = min(pooled[a - 1] * shape[a] / shape[a - 1], 1.0)
            pooled[a] = (all_hits[a] + k * prior) / (all_opp[a] + k)
        return (hits + k * pooled) / (opp + k)

    def _rebuild(self) -> None:
        """Occupancy per hit ``C[class][age]`` from the hazard table (module docstring)."""
        h = self.hazard()
        top = self.max_age
        R = np.empty_like(h)  # mean visits to the next request (waiting as long as it takes)
        R[:, top] = 1.0 / np.maximum(h[:, top], 1e-9)
        for a in range(top - 1, -1, -1):
            R[:, a] = 1.0 + (1.0 - h[:, a]) * R[:, a + 1]
        C = R.copy()  # holding for ever is one horizon; try every shorter one
        # every start age a at once: step s holds from age a to age a + s (the same float
        # operations, in the same order, as a loop over a and then over the ages)
        q = 1.0 - h
        alive = np.ones_like(h)  # [class, a]: P(no request yet)
        held = np.zeros_like(h)  # expected visits held so far
        for step in range(top + 1):
            n = top + 1 - step  # the start ages with a + step <= top
            held[:, :n] += alive[:, :n]
            alive[:, :n] = alive[:, :n] * q[:, step:]
            C[:, :n] = np.minimum(C[:, :n], held[:, :n] / np.maximum(1.0 - alive[:, :n], 1e-12))
        self._C = C.tolist()
        self._Carr = C

    def _arrays(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray]:
        lv = self._lv.get(layer)
        if lv is None or expert >= len(lv):
            size = max(self.n_experts, expert + 1, 0 if lv is None else len(lv))
            new_lv = np.full(size, -1, dtype=np.int64)
            new_cnt = np.zeros(size, dtype=np.int64)
            if lv is not None:
                new_lv[: len(lv)] = lv
                new_cnt[: len(lv)] = self._cnt[layer]
            self._lv[layer], self._cnt[layer] = new_lv, new_cnt
        return self._lv[layer], self._cnt[layer]

    def _predict(self, key: int) -> float:
        layer = key >> KEY_SHIFT
        last = self._klv.get(key)
        if last is None:
            c, age = 0, 0
        else:
            c = _CLASS_LIST[min(self._kcnt[key], 32)]
            age = min(self._visits.get(layer, 0) - last, self.max_age)
        return self._vtick.get(layer, self._tick) + self._period * self._C[c][age]

    def _predict_layer(self, layer: int, keys: list[int]) -> list[float]:
        """``_predict`` of every key of ``layer`` in ``keys`` at once (the same float
        operations, so the same values), from the layer's arrays instead of the per-key
        dicts (they hold the same facts)."""
        n = len(keys)
        lv, cnt = self._lv.get(layer), self._cnt.get(layer)
        if lv is None or cnt is None:
            c = age = np.zeros(n, dtype=np.int64)
        else:
            exp = np.fromiter((k & EXPERT_MASK for k in keys), dtype=np.int64, count=n)
            inside = exp < len(lv)
            e = np.where(inside, exp, 0)
            last = np.where(inside, lv[e], -1)
            seen = last >= 0
            c = np.where(seen, _CLASS_OF[np.minimum(np.where(inside, cnt[e], 0), 32)], 0)
            age = np.where(seen, np.minimum(self._visits.get(layer, 0) - last, self.max_age), 0)
        base = self._vtick.get(layer, self._tick)
        out: list[float] = (base + self._period * self._Carr[c, age]).tolist()
        return out

    # ---- heap --------------------------------------------------------------------------
    def _set_eta(self, key: int, eta: float) -> None:
        self._eta[key] = eta
        self._seq += 1
        self._ver[key] = self._seq
        if self._heap_live:
            heapq.heappush(self._heap, (-eta, self._seq, key))
            if len(self._heap) > 4 * self.capacity + 64:
                self._build_heap()

    def _build_heap(self) -> None:
        self._heap = [(-e, self._ver[k], k) for k, e in self._eta.items()]
        heapq.heapify(self._heap)
        self._heap_live = True

    def _peek_victim(self, protected: Container[int]) -> int | None:
        if not self._heap_live:
            self._build_heap()
        return top_unprotected(
            self._heap, lambda e: self._ver.get(e[2]) == e[1] and e[2] in self._eta, protected)

    # ---- events ------------------------------------------------------------------------
    def begin_token(self) -> None:
        self._passes += 1
        if self._ticks_this_pass:
            self._period = float(self._ticks_this_pass)
        self._ticks_this_pass = 0
        self._layer = -1
        keep = 1.0 - 1.0 / self.horizon
        self._opp *= keep
        self._hits *= keep
        self._rebuild()

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        if layer == self._layer:
            # the same layer again without a new pass: more requests of the same visit
            for k in keys:
                self._remaining[k] = self._remaining.get(k, 0) + 1
            for k in self._remaining:
                self._request(k)
        else:
            self._new_visit(layer, keys)
        self._refresh(layer)

    def _refresh(self, layer: int) -> None:
        """Every resident of ``layer`` gets its ETA again: the current tick if this visit
        requests it, else ``_predict``'s. ``_set_eta``'s bookkeeping is done in the loop and
        the heap rebuilt at most once after it (the valid entries, so every victim, are the
        same): this runs for every resident of every layer visited."""
        residents = self._res_layer.get(layer)
        if not residents:
            return
        keys = list(residents)
        tick, remaining = float(self._tick), self._remaining
        eta_of, ver, heap, live, seq = self._eta, self._ver, self._heap, self._heap_live, self._seq
        for k, predicted in zip(keys, self._predict_layer(layer, keys), strict=True):
            eta = tick if k in remaining else predicted
            eta_of[k] = eta
            seq += 1
            ver[k] = seq
            if live:
                heapq.heappush(heap, (-eta, seq, k))
        self._seq = seq
        if live and len(heap) > 4 * self.capacity + 64:
            self._build_heap()

    def _new_visit(self, layer: int, keys: Sequence[int]) -> None:
        self._tick += 1
        self._ticks_this_pass += 1
        visit = self._visits.get(layer, 0) + 1
        self._visits[layer] = visit
        self._vtick[layer] = self._tick
        self._layer = layer
        remaining: dict[int, int] = {}
        for k in keys:
            remaining[k] = remaining.get(k, 0) + 1
        self._remaining = remaining
        own = [k for k in remaining if k >> KEY_SHIFT == layer]
        idx = np.fromiter((k & EXPERT_MASK for k in own), dtype=np.int64, count=len(own))
        lv, cnt = self._arrays(layer, int(idx.max(initial=0)))
        width, size = self.max_age + 1, N_CLASSES * (self.max_age + 1)
        seen = lv >= 0
        if seen.any():  # every expert of this layer seen before has an opportunity now
            cell = _CLASS_OF[np.minimum(cnt[seen], 32)] * width
            cell += np.minimum(visit - 1 - lv[seen], self.max_age)
            self._opp += np.bincount(cell, minlength=size)
        if own:  # ... and it is a hit for those requested now
            prev = lv[idx]
            back = prev >= 0
            if back.any():
                cell = _CLASS_OF[np.minimum(cnt[idx[back]], 32)] * width
                cell += np.minimum(visit - 1 - prev[back], self.max_age)
                self._hits += np.bincount(cell, minlength=size)
            lv[idx] = visit
            cnt[idx] += 1
            klv, kcnt = self._klv, self._kcnt
            for k in own:
                klv[k] = visit
                kcnt[k] = kcnt.get(k, 0) + 1
        for k in remaining:
            if k >> KEY_SHIFT != layer:
                self._request(k)  # announced under another layer: noted, no statistics
        if self._passes <= 1 and len(keys) >= 2 * self.topk and len(keys) % self.topk == 0:
            self._learn_positions(keys)

    def _learn_positions(self, keys: Sequence[int]) -> None:
        """Hazard by age between the positions of a batched visit of the first pass."""
        positions = len(keys) // self.topk
        seen_at: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            at = seen_at.setdefault(k, [])
            if not at or at[-1] != i // self.topk:
                at.append(i // self.topk)
        top = self.max_age
        for at in seen_at.values():
            for here, there in zip(at, [*at[1:], None], strict=True):
                # positions after `here`: `gap` opportunities, the last one a hit if `there`
                gap = (positions - 1 - here) if there is None else (there - here)
                self._pos_opp[: min(gap, top)] += 1.0
                if gap > top:
                    self._pos_opp[top] += gap - top
                if there is not None:
                    self._pos_hits[min(gap - 1, top)] += 1.0

    def _request(self, key: int) -> None:
        """Note a request of ``key`` in its layer's current visit (once per visit)."""
        layer = key >> KEY_SHIFT
        visit = self._visits.get(layer, 0)
        last = self._klv.get(key)
        if last == visit:
            return
        count = self._kcnt.get(key, 0)
        if last is not None and layer == self._layer:  # the opportunity counted is a hit
            age = min(visit - 1 - last, self.max_age)
            self._hits[_CLASS_LIST[min(count, 32)] * (self.max_age + 1) + age] += 1.0
        expert = key & EXPERT_MASK
        lv, cnt = self._arrays(layer, expert)
        lv[expert] = visit
        cnt[expert] = count + 1
        self._klv[key] = visit
        self._kcnt[key] = count + 1

    def _consume(self, key: int) -> bool:
        """Count one request of ``key`` in this visit; True if more are to come."""
        left = self._remaining.get(key, 0) - 1
        if left > 0:
            self._remaining[key] = left
            return True
        if self._remaining.pop(key, None) is None:
            self._request(key)  # a request begin_layer did not announce
        return False

    def on_hit(self, key: int) -> None:
        if not self._consume(key) and key in self._eta:
            self._set_eta(key, self._predict(key))

    def admit(self, key: int, protected: Container[int]) -> bool:
        eta = float(self._tick) if self._consume(key) else self._predict(key)
        self._pending = (key, eta)
        if len(self._eta) < self.capacity:
            return True
        victim = self._peek_victim(protected)
        return victim is not None and eta < self._eta[victim]

    def choose_victim(self, protected: Container[int]) -> int | None:
        return self._peek_victim(protected)

    def on_insert(self, key: int) -> None:
        self._res_layer.setdefault(key_layer(key), {})[key] = None
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            self._set_eta(key, pending[1])
        else:  # inserted without a request (a prefetch)
            self._set_eta(key, self._predict(key))

    def on_evict(self, key: int) -> None:
        self._res_layer[key_layer(key)].pop(key, None)
        del self._eta[key]

    def describe(self) -> str:
        h = self.hazard()
        return (
            f"cycle-eta ({len(self._eta)} resident; P(reuse next pass) {100 * h[0, 0]:.1f} % "
            f"for a new expert, {100 * h[-1, 0]:.1f} % for a hot one; "
            f"{self._period:.0f} layer visits per pass)"
        )
