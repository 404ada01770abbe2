"""The ``fifo`` policy: evict the oldest unprotected resident expert."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from k3.plugin import CachePolicy


class FIFOPolicy(CachePolicy):
    """First in, first out. Admits every miss; ``choose_victim`` walks from the oldest end
    past protected keys only, so each event is O(1) amortised."""

    name = "fifo"

    def __init__(self, capacity: int, **options: Any):  # unknown options are ignored
        super().__init__(capacity, **options)
        self._order: dict[int, None] = {}  # insertion-ordered: the queue

    def admit(self, key: int, protected: Container[int]) -> bool:
        return True

    def choose_victim(self, protected: Container[int]) -> int | None:
        for key in self._order:
            if key not in protected:
                return key
        return None  # every resident expert is protected

    def on_insert(self, key: int) -> None:
        self._order[key] = None

    def on_evict(self, key: int) -> None:
        self._order.pop(key, None)  # also a failed read the policy did not choose

    def describe(self) -> str:
        return f"fifo ({len(self._order)} of {self.capacity} slots)"
