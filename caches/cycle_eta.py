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
``begin_layer`` receives all of the layer's requests in order (the router runs before any
expert is loaded). A key with further requests in this visit has ``ETA = now + f``, ``f`` in
``[0, 1)`` growing with the place of its next request in the visit (``p / (p + 1)``): it is
admitted even into a full cache, it goes only after every key not needed again in the visit
(those are a whole tick away at least), and among the visit's own keys the one needed last
goes first, which is Belady's rule inside a visit of many rows (a prefill chunk, a batched
step). After its last request in the visit its ETA returns to the prediction. The engine's
cache announces each key once per visit (it serves all of a key's rows with one use), so
there a key's need in the visit ends at its first request; a replay that makes every
request in turn (``k3 sim-cache``'s default, the reference's) announces the repeats too.

Cost
----
``begin_layer`` is O(n_experts) in numpy (per-layer arrays of last-request visit and request
count feed the hazard counts) plus O(distinct keys) in Python; the residents' ETAs live in
arrays indexed by a slot position, so a visit refreshes its layer's residents in one numpy
pass (their positions and experts are kept per layer between insertions and evictions).
A victim search is an argmax over the residents (ties go to the ETA set longest ago, as a
heap on ``(-ETA, version)`` would give them), repeated past each protected key it meets:
O(C) in numpy, and the engine's caches evict a few keys a pass while every pass refreshes
every resident. Other events are O(1). ``begin_token`` costs O(max_age**2) for the table.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

import numpy as np

from k3.plugin import EXPERT_MASK, KEY_SHIFT, CachePolicy, UsageError, key_layer

N_CLASSES = 6  # floor(log2(requests)) buckets: 1, 2-3, 4-7, 8-15, 16-31, 32+
_CLASS_OF = np.minimum(np.floor(np.log2(np.maximum(np.arange(33), 1))), N_CLASSES - 1)
_CLASS_OF = _CLASS_OF.astype(np.int64)
_CLASS_LIST: list[int] = _CLASS_OF.tolist()


def _positions(keys: Sequence[int], base: int = 0) -> dict[int, list[int]]:
    """Per key, its places in ``keys`` (from ``base``), latest first."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(keys, base):
        out.setdefault(k, []).append(i)
    for at in out.values():
        at.reverse()
    return out


def _soon(at: int) -> float:
    """Where in its visit a request at place ``at`` comes, as a fraction of a tick: grows
    with ``at`` and stays under 1, so a key requested again in the visit ranks by when, and
    before every key whose layer comes round later (at least a tick away)."""
    return at / (at + 1.0)


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
        # the current visit: its layer, its length so far, and per key the positions in it
        # of the requests still to come (latest first: the next one is last)
        self._layer = -1
        self._visit_len = 0
        self._remaining: dict[int, list[int]] = {}
        # residents: a position each in the ETA / version / key arrays (-inf ETA where free);
        # per layer, its residents' (keys, positions, experts), rebuilt after it changes
        self._pos: dict[int, int] = {}
        size = max(self.capacity, 1)
        self._eta_at = np.full(size, -np.inf)
        self._ver_at = np.zeros(size, dtype=np.int64)
        self._key_at = np.full(size, -1, dtype=np.int64)
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._layer_res: dict[int, tuple[list[int], np.ndarray, np.ndarray]] = {}
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
        dims = (N_CLASSES, self.max_age + 1)
        hits, opp = self._hits.reshape(dims), self._opp.reshape(dims)
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
        exp = np.fromiter((k & EXPERT_MASK for k in keys), dtype=np.int64, count=len(keys))
        out: list[float] = self._predict_experts(layer, exp).tolist()
        return out

    def _predict_experts(self, layer: int, exp: np.ndarray) -> np.ndarray:
        """``_predict_layer`` for the experts ``exp`` of ``layer``, as an array."""
        lv, cnt = self._lv.get(layer), self._cnt.get(layer)
        if lv is None or cnt is None:
            c = age = np.zeros(len(exp), dtype=np.int64)
        else:
            inside = exp < len(lv)
            e = np.where(inside, exp, 0)
            last = np.where(inside, lv[e], -1)
            seen = last >= 0
            c = np.where(seen, _CLASS_OF[np.minimum(np.where(inside, cnt[e], 0), 32)], 0)
            age = np.where(seen, np.minimum(self._visits.get(layer, 0) - last, self.max_age), 0)
        base = self._vtick.get(layer, self._tick)
        out: np.ndarray = base + self._period * self._Carr[c, age]
        return out

    # ---- the residents' ETAs -----------------------------------------------------------
    def _set_eta(self, key: int, eta: float) -> None:
        p = self._pos[key]
        self._seq += 1
        self._eta_at[p] = eta
        self._ver_at[p] = self._seq

    def _eta(self, key: int) -> float:
        return float(self._eta_at[self._pos[key]])

    def _residents_of(self, layer: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The residents of ``layer`` in insertion order, their positions and experts."""
        got = self._layer_res.get(layer)
        if got is None:
            keys = list(self._res_layer.get(layer, ()))
            pos = np.fromiter((self._pos[k] for k in keys), dtype=np.int64, count=len(keys))
            got = self._layer_res[layer] = (keys, pos, self._key_at[pos] & EXPERT_MASK)
        return got

    def _peek_victim(self, protected: Container[int]) -> int | None:
        """The resident with the largest ETA that is not protected; among equal ETAs the one
        whose ETA was set first (the order of a heap on ``(-ETA, version)``)."""
        eta = self._eta_at
        for _ in range(len(self._pos)):
            j = int(np.argmax(eta))
            m = eta[j]
            if m == -np.inf:
                return None
            tied = np.flatnonzero(eta == m)
            if len(tied) > 1:
                j = int(tied[np.argmin(self._ver_at[tied])])
            key = int(self._key_at[j])
            if key not in protected:
                return key
            if eta is self._eta_at:
                eta = eta.copy()
            eta[j] = -np.inf  # protected: the next best
        return None

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
            more = _positions(keys, self._visit_len)
            self._visit_len += len(keys)
            for k, at in more.items():
                self._remaining[k] = at + self._remaining.get(k, [])
            for k in self._remaining:
                self._request(k)
        else:
            self._new_visit(layer, keys)
        self._refresh(layer)

    def _refresh(self, layer: int) -> None:
        """Every resident of ``layer`` gets its ETA again: the place of its next request in
        this visit if the visit requests it (:func:`_soon`), else ``_predict``'s, with
        versions in the residents' insertion order (as ``_set_eta`` one key at a time would
        give them), in one numpy pass: this runs for every resident of every layer visited."""
        if not self._res_layer.get(layer):
            return
        keys, pos, exp = self._residents_of(layer)
        eta = self._predict_experts(layer, exp)
        tick, res = float(self._tick), self._res_layer[layer]
        for k, at in self._remaining.items():  # requested in this visit: needed now
            if k in res:
                eta[keys.index(k)] = tick + _soon(at[-1])
        self._eta_at[pos] = eta
        self._ver_at[pos] = np.arange(self._seq + 1, self._seq + 1 + len(keys))
        self._seq += len(keys)

    def _new_visit(self, layer: int, keys: Sequence[int]) -> None:
        self._tick += 1
        self._ticks_this_pass += 1
        visit = self._visits.get(layer, 0) + 1
        self._visits[layer] = visit
        self._vtick[layer] = self._tick
        self._layer = layer
        remaining = self._remaining = _positions(keys)
        self._visit_len = len(keys)
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
        """Hazard by age between the positions of a batched visit of the first pass.

        Each key's distinct positions in order; from each, ``gap`` positions to its next one
        (a hit at age ``gap - 1``) or to the end of the batch: ages ``0 .. gap - 1`` are
        opportunities, those past ``max_age`` lumped into its cell. Counted for all keys at
        once in numpy; every count is a whole number, so the float sums are exact and the
        same as adding the pairs one by one."""
        n = len(keys)
        positions = n // self.topk
        top = self.max_age
        k = np.fromiter(keys, dtype=np.int64, count=n)
        at = np.arange(n, dtype=np.int64) // self.topk
        order = np.lexsort((at, k))  # by key, then position
        k, at = k[order], at[order]
        first = np.ones(n, dtype=bool)  # a key's first request at a position
        first[1:] = (k[1:] != k[:-1]) | (at[1:] != at[:-1])
        k, at = k[first], at[first]
        again = np.zeros(len(k), dtype=bool)  # the key comes back at a later position
        again[:-1] = k[1:] == k[:-1]
        gap = positions - 1 - at
        gap[:-1] = np.where(again[:-1], at[1:] - at[:-1], gap[:-1])
        per = np.bincount(np.minimum(gap, top), minlength=top + 1)  # pairs per min(gap, top)
        self._pos_opp[:top] += np.cumsum(per[::-1])[::-1][1:]  # age a: pairs with gap > a
        self._pos_opp[top] += float((gap[gap > top] - top).sum())
        self._pos_hits += np.bincount(np.minimum(gap[again] - 1, top), minlength=top + 1)

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

    def _consume(self, key: int) -> float | None:
        """Count one request of ``key`` in this visit: the ETA of its next request in this
        visit, or ``None`` if no more are to come."""
        at = self._remaining.get(key)
        if at is None:
            self._request(key)  # a request begin_layer did not announce
            return None
        at.pop()
        if at:
            return self._tick + _soon(at[-1])
        del self._remaining[key]
        return None

    def on_hit(self, key: int) -> None:
        eta = self._consume(key)
        if key in self._pos:
            self._set_eta(key, self._predict(key) if eta is None else eta)

    def admit(self, key: int, protected: Container[int]) -> bool:
        eta = self._consume(key)
        if eta is None:
            eta = self._predict(key)
        self._pending = (key, eta)
        if len(self._pos) < self.capacity:
            return True
        victim = self._peek_victim(protected)
        return victim is not None and eta < self._eta(victim)

    def choose_victim(self, protected: Container[int]) -> int | None:
        return self._peek_victim(protected)

    def on_insert(self, key: int) -> None:
        layer = key_layer(key)
        self._res_layer.setdefault(layer, {})[key] = None
        self._layer_res.pop(layer, None)
        if key not in self._pos:
            if not self._free:  # more residents than slots (a cache that overfills): grow
                n = len(self._eta_at)
                self._eta_at = np.concatenate([self._eta_at, np.full(n, -np.inf)])
                self._ver_at = np.concatenate([self._ver_at, np.zeros(n, dtype=np.int64)])
                self._key_at = np.concatenate([self._key_at, np.full(n, -1, dtype=np.int64)])
                self._free = list(range(2 * n - 1, n - 1, -1))
            p = self._pos[key] = self._free.pop()
            self._key_at[p] = key
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            self._set_eta(key, pending[1])
        else:  # inserted without a request (a prefetch)
            self._set_eta(key, self._predict(key))

    def on_evict(self, key: int) -> None:
        layer = key_layer(key)
        self._res_layer[layer].pop(key, None)
        self._layer_res.pop(layer, None)
        p = self._pos.pop(key)
        self._eta_at[p] = -np.inf
        self._key_at[p] = -1
        self._free.append(p)

    def describe(self) -> str:
        h = self.hazard()
        return (
            f"cycle-eta ({len(self._pos)} resident; P(reuse next pass) {100 * h[0, 0]:.1f} % "
            f"for a new expert, {100 * h[-1, 0]:.1f} % for a hot one; "
            f"{self._period:.0f} layer visits per pass)"
        )
