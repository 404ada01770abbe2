"""Textbook cache policies written only against ``k3.plugin``: each obeys the policy contract
while making decisions no LRU figure predicts, so the shipped suites must accept them."""

from __future__ import annotations

import random
from collections.abc import Container
from typing import Any

from k3.plugin import CachePolicy


class FIFOPolicy(CachePolicy):
    """First in, first out: a hit changes nothing."""

    name = "fifo"

    def __init__(self, capacity: int, **options: Any):
        super().__init__(capacity, **options)
        self._order: dict[int, None] = {}

    def admit(self, key: int, protected: Container[int]) -> bool:
        return True

    def choose_victim(self, protected: Container[int]) -> int | None:
        return next((k for k in self._order if k not in protected), None)

    def on_insert(self, key: int) -> None:
        self._order[key] = None

    def on_evict(self, key: int) -> None:
        self._order.pop(key, None)


class EvictNewestPolicy(FIFOPolicy):
    """Evict the most recently inserted unprotected expert (the opposite of FIFO)."""

    name = "newest"

    def choose_victim(self, protected: Container[int]) -> int | None:
        return next((k for k in reversed(self._order) if k not in protected), None)


class RandomPolicy(FIFOPolicy):
    """Evict a uniformly random unprotected expert (seeded: decisions are reproducible)."""

    name = "random"

    def __init__(self, capacity: int, seed: int = 0, **options: Any):
        super().__init__(capacity, **options)
        self._rng = random.Random(seed)

    def choose_victim(self, protected: Container[int]) -> int | None:
        free = [k for k in self._order if k not in protected]
        return self._rng.choice(free) if free else None
