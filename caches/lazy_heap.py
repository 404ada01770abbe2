"""The victim search the heap-ordered policies share (``cycle-eta``, ``replay``).

Both keep a *lazy* heap of ``(priority, seq, key)`` entries: an update pushes a new entry
and leaves the old one in place, so the top may be stale. :func:`top_unprotected` finds
the best live, evictable key without disturbing the heap's meaning.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container

Entry = tuple[float, int, int]


def top_unprotected(heap: list[Entry], live: Callable[[Entry], bool],
                    protected: Container[int]) -> int | None:
    """The key of the best entry that is ``live`` and not ``protected``, or ``None``.

    Stale entries met on the way are dropped for good; protected ones are set aside and
    pushed back, so they keep their place for a later search.
    """
    aside: list[Entry] = []
    found = None
    while heap:
        entry = heap[0]
        if not live(entry):
            heapq.heappop(heap)
            continue
        if entry[2] in protected:
            aside.append(heapq.heappop(heap))
            continue
        found = entry[2]
        break
    for item in aside:
        heapq.heappush(heap, item)
    return found
