"""``lru``: evict the least recently used expert (the reference engine's original policy).

Over the fixed layer cycle an LRU evicts every expert just before its layer comes round
again once the per-token working set exceeds the slots, so it is the baseline to beat,
not a recommendation. Each event is O(1) (an ordered dict); ``choose_victim`` walks from
the old end past protected keys only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import Any

from k3.plugin import CachePolicy


class LRUPolicy(CachePolicy):
    """Plain LRU; admits every miss."""

    name = "lru"

    def __init__(self, capacity: int, **options: Any):
        super().__init__(capacity, **options)
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_hit(self, key: int) -> None:
        self._order.move_to_end(key)

    def admit(self, key: int, protected: Container[int]) -> bool:
        return True

    def choose_victim(self, protected: Container[int]) -> int | None:
        for key in self._order:
            if key not in protected:
                return key
        return None

    def on_insert(self, key: int) -> None:
        self._order[key] = None

    def on_evict(self, key: int) -> None:
        del self._order[key]

    def touch(self, key: int) -> None:
        """Mark ``key`` most recently used if resident (used by policies that embed an LRU)."""
        if key in self._order:
            self._order.move_to_end(key)

    def __len__(self) -> int:
        return len(self._order)
