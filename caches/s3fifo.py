"""``s3fifo``: plain S3-FIFO, as the reference engine runs it (kept for comparison).

Yang et al., "FIFO queues are all you need for cache eviction" (SOSP 2023), with the
reference's parameters: a small FIFO of 10 % of the slots (at least one) takes new
admissions; a main FIFO holds experts that were touched again while in the small queue; a
ghost list of the last ``capacity`` keys evicted from the small queue sends a returning key
straight to main; a saturating frequency of at most 3 per resident key. Eviction takes from
the small queue while it holds at least its share (a touched key is promoted to main
instead, its frequency reset to 0), otherwise from main (a touched key has its frequency
decremented and is requeued). Protected keys are requeued; if both queues bounce their
whole length there is no victim. With nothing protected this reproduces the reference
simulator's figures on the shipped trace (docs/engine-behaviours.md §8: 35.32, 36.11, 42.68,
49.97 % at 455, 911, 1,823, 3,647 slots; the reference's ghost set forgets a key readmitted
from it a little differently, which shows at larger sizes only).

Every event is amortised O(1). Queue entries carry a generation number so an ``on_evict``
the policy did not choose (a failed read, say) just leaves a stale entry to skip.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container
from typing import Any

from k3.plugin import CachePolicy

SMALL, MAIN = 0, 1
FREQ_CAP = 3


class S3FIFOPolicy(CachePolicy):
    """S3-FIFO with a 10 % small queue, a ghost of ``capacity`` keys and frequency cap 3."""

    name = "s3fifo"

    def __init__(self, capacity: int, *, small_fraction: float = 0.10, **options: Any):
        super().__init__(capacity, **options)
        self.small_target = max(1, int(self.capacity * float(small_fraction)))
        self._queues: tuple[deque[tuple[int, int]], deque[tuple[int, int]]] = (deque(), deque())
        self._count = [0, 0]
        self._where: dict[int, tuple[int, int]] = {}  # key -> (queue, generation)
        self._freq: dict[int, int] = {}
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._gen = 0

    # ---- events ----------------------------------------------------------------------
    def on_hit(self, key: int) -> None:
        f = self._freq.get(key)
        if f is not None and f < FREQ_CAP:
            self._freq[key] = f + 1

    def admit(self, key: int, protected: Container[int]) -> bool:
        return True

    def on_insert(self, key: int) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._push(MAIN, key)
        else:
            self._push(SMALL, key)
        self._freq[key] = 0

    def on_evict(self, key: int) -> None:
        queue, _ = self._where.pop(key)
        self._count[queue] -= 1
        del self._freq[key]
        if queue == SMALL:
            self._ghost[key] = None
            if len(self._ghost) > self.capacity:
                self._ghost.popitem(last=False)

    def choose_victim(self, protected: Container[int]) -> int | None:
        # bounces[q]: protected keys requeued in q since q last made progress; once a queue
        # has bounced its whole length it holds nothing evictable
        bounces = [0, 0]
        while True:
            queue = (
                SMALL
                if (self._count[SMALL] >= self.small_target or not self._count[MAIN])
                else MAIN
            )
            if bounces[queue] >= self._count[queue]:
                queue = 1 - queue
                if bounces[queue] >= self._count[queue]:
                    return None
            key = self._pop(queue)
            if key is None:  # only stale entries were left
                bounces[queue] = self._count[queue]
                continue
            if key in protected:
                self._push(queue, key)
                bounces[queue] += 1
            elif self._freq[key] > 0:
                # promotion from small starts over at 0; main spends one touch per pass
                self._freq[key] = 0 if queue == SMALL else self._freq[key] - 1
                self._push(MAIN, key)
                bounces[queue] = 0
            else:
                # the victim stays counted under its queue until on_evict
                self._where[key] = (queue, -1)
                return key

    # ---- queues ----------------------------------------------------------------------
    def _push(self, queue: int, key: int) -> None:
        old = self._where.get(key)
        if old is not None:
            self._count[old[0]] -= 1
        self._gen += 1
        self._where[key] = (queue, self._gen)
        self._queues[queue].append((key, self._gen))
        self._count[queue] += 1

    def _pop(self, queue: int) -> int | None:
        q = self._queues[queue]
        while q:
            key, gen = q.popleft()
            if self._where.get(key) == (queue, gen):
                return key
        return None

    def describe(self) -> str:
        return (
            f"S3-FIFO (small {self._count[SMALL]} of {self.small_target} target, "
            f"main {self._count[MAIN]}, ghost {len(self._ghost)} keys)"
        )
