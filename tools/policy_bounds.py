"""How much of the LRU-to-Belady gap other eviction rules close on a trace: is what separates
``cycle-eta`` from Belady a rule, or foresight?

``k3 sim-cache`` compares the registered policies. This study adds rules that are not worth
registering but answer that question (docs/expert-cache.md, "Routing patterns"):

``cycle-eta h8`` / ``h64`` / ``s2`` / ``s32``
    the default with a shorter or longer hazard horizon, or less or more shrinkage;
``lfu``
    evict the resident requested in the fewest visits so far (ties: least recently used),
    admit a miss only if it has been requested at least as often as that victim;
``lrfu 0.05`` / ``0.2`` / ``1``
    LRFU (Lee et al., IEEE ToC 2001): each key's requests weighted ``2 ** (-lambda * passes
    since)``, the lightest evicted, a miss admitted only if it is not lighter; lambda near 0
    is LFU, large lambda is LRU;
``popularity oracle``
    LFU told every key's request count over the *whole* trace in advance: frequency with
    perfect knowledge of the future's frequencies, which no online rule has.

If even the oracle closes about what ``cycle-eta`` closes, the rest of the gap is which
expert comes back *when*, which only the future says::

    python tools/policy_bounds.py TRACE --model demo-model [--slots 8,16,32,64,128]
        [--serve visits|requests]
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Container, Sequence
from pathlib import Path
from typing import Any

from k3_caches.cycle_eta import CycleETAPolicy
from k3_caches.lru import LRUPolicy

from k3core.api.cache_policy import CachePolicy
from k3core.experts.locator import pool_shape
from k3core.experts.simulator import BELADY, TraceView, simulate
from k3core.experts.trace import read_trace


class _Scored(CachePolicy):
    """Evict the resident with the lowest ``score`` (ties: the one touched longest ago),
    never one of the visit being served; admit a miss only if it scores at least as high."""

    name = "scored"

    def __init__(self, capacity: int, **options: Any):
        super().__init__(capacity, **options)
        self.resident: dict[int, int] = {}  # key -> tick of its last touch
        self.tick = 0
        self.visit: set[int] = set()

    def score(self, key: int) -> float:
        raise NotImplementedError

    def begin_token(self) -> None:
        pass

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        self.visit = set(keys)

    def on_hit(self, key: int) -> None:
        self.tick += 1
        self.resident[key] = self.tick

    def admit(self, key: int, protected: Container[int]) -> bool:
        if len(self.resident) < self.capacity:
            return True
        victim = self.choose_victim(protected)
        return victim is not None and self.score(victim) <= self.score(key)

    def choose_victim(self, protected: Container[int]) -> int | None:
        for spare in (self.visit, ()):  # keys of the visit only when nothing else is left
            out = [(self.score(k), t, k) for k, t in self.resident.items()
                   if k not in protected and k not in spare]
            if out:
                return min(out)[2]
        return None

    def on_insert(self, key: int) -> None:
        self.tick += 1
        self.resident[key] = self.tick

    def on_evict(self, key: int) -> None:
        del self.resident[key]


class LFU(_Scored):
    """Requests so far, one a visit."""

    def __init__(self, capacity: int, **options: Any):
        super().__init__(capacity, **options)
        self.count: Counter[int] = Counter()

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        super().begin_layer(layer, keys)
        self.count.update(set(keys))

    def score(self, key: int) -> float:
        return self.count[key]


class PopularityOracle(LFU):
    """Every key's visits over the whole trace, known from the start (``counts``)."""

    def __init__(self, capacity: int, counts: Counter[int] | None = None, **options: Any):
        super().__init__(capacity, **options)
        self.count = Counter(counts or {})

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        self.visit = set(keys)


class LRFU(_Scored):
    """Requests weighted by ``2 ** (-lam * passes since)``."""

    def __init__(self, capacity: int, lam: float = 0.2, **options: Any):
        super().__init__(capacity, **options)
        self.lam = lam
        self.now = 0
        self.crf: dict[int, tuple[float, int]] = {}  # key -> (weight, pass it was set)

    def begin_token(self) -> None:
        self.now += 1

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        super().begin_layer(layer, keys)
        for k in dict.fromkeys(keys):
            self.crf[k] = (self.score(k) + 1.0, self.now)

    def score(self, key: int) -> float:
        w, at = self.crf.get(key, (0.0, self.now))
        return w * 0.5 ** (self.lam * (self.now - at))


def visit_counts(pairs: Any) -> Counter[int]:
    """Per key, the layer visits that ask for it (``TraceView``'s visits)."""
    view = TraceView.of(pairs)
    out: Counter[int] = Counter()
    for start, end, _, _ in view.visits:
        out.update(set(view.keys[start:end]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="expert_trace.bin (gzipped is fine)")
    ap.add_argument("--model", type=Path, required=True, help="the model directory (top-k, "
                    "layer and expert counts)")
    ap.add_argument("--slots", default="8,16,32,64,128")
    ap.add_argument("--serve", default="visits", choices=("visits", "requests"))
    args = ap.parse_args(argv)
    shape = pool_shape(args.model)
    pairs = read_trace(args.trace)
    counts = visit_counts(pairs)

    def eta(**kw: Any) -> Any:
        return lambda **o: CycleETAPolicy(**{**o, **kw})

    def lrfu(lam: float) -> Any:
        return lambda **o: LRFU(lam=lam, **o)

    factories: dict[str, Any] = {
        "lru": lambda **o: LRUPolicy(**o),
        "cycle-eta": eta(),
        "cycle-eta h8": eta(horizon=8), "cycle-eta h64": eta(horizon=64),
        "cycle-eta s2": eta(shrink=2.0), "cycle-eta s32": eta(shrink=32.0),
        "lfu": lambda **o: LFU(**o),
        **{f"lrfu {lam:g}": lrfu(lam) for lam in (0.05, 0.2, 1.0)},
        "popularity oracle": lambda **o: PopularityOracle(counts=counts, **o),
    }
    slots = [int(s) for s in args.slots.split(",")]
    res = simulate(pairs, slots, factories, topk=shape.topk, n_layers=shape.n_layers,
                   n_experts=shape.n_experts, serve=args.serve)
    print(f"{args.trace.name}: the share of the LRU-to-Belady gap each rule closes "
          f"(serve={args.serve}; '-': no gap)")
    print(f"{'rule':20}" + "".join(f"{s:>8}" for s in slots))
    for name in factories:
        if name == "lru":
            continue
        cells = []
        for row in res.rows:
            lru, best = row.hit_rate["lru"], row.hit_rate[BELADY]
            cells.append("-" if best - lru < 1e-12 else
                         f"{100 * (row.hit_rate[name] - lru) / (best - lru):.0f} %")
        print(f"{name:20}" + "".join(f"{c:>8}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
