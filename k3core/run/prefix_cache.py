"""The prefix cache: states at the end of prompt prefixes, kept across requests.

A server's requests often start alike: the same system prompt, a chat that sends back its
earlier turns, the same document asked about twice. :class:`PrefixCache` keeps the state a
sequence reached after some ids (a :class:`~k3core.model.state.StateSnapshot`: every KDA
layer's recurrent state and conv history, every MLA layer's latent KV rows) under those ids,
up to a byte budget, and evicts the least recently used. A request whose prompt starts with
a kept prefix (and goes on past it) restores that state and feeds only the rest.

With a spill (:class:`~k3core.run.prefix_spill.PrefixSpill`, ``--prefix-cache-dir``) the
states the budget evicts go to disk instead of away, and a lookup whose longest kept prefix
is on disk reads it back into memory.

**Bits.** A sequence split into calls gives the bytes of one pass, and a restored snapshot
holds the bytes the state held, so a request that starts from a kept prefix gets the logits a
fresh run gives (``tests/serve/test_prefix_cache.py``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from k3core.model.state import SequenceState, StateSnapshot, snapshot

if TYPE_CHECKING:
    from k3core.run.prefix_spill import PrefixSpill


def kept_bytes(state: SequenceState) -> int:
    """Bytes a snapshot of ``state`` holds (its consumed KV rows, every KDA layer's state and
    conv history), known before anything is copied."""
    n = sum(kv.rows[: state.pos].nbytes for kv in state.kv.values())
    for st in state.kda.values():
        n += st.S.nbytes + sum(h.nbytes for h in st.conv.values())
    return n


def kept_snapshot_bytes(snap: StateSnapshot) -> int:
    """Bytes ``snap`` holds (as :func:`kept_bytes` counts its state's)."""
    n = sum(rows.nbytes for rows in snap.kv.values())
    for S, conv in snap.kda.values():
        n += S.nbytes + sum(h.nbytes for h in conv.values())
    return n


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    cached_tokens: int = 0
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    """Kept states by the ids that led to them, at most ``budget`` bytes (see the module)."""

    def __init__(self, budget: int, spill: PrefixSpill | None = None):
        self.budget = max(0, int(budget))
        self.spill = spill
        #: ids -> (their state, its bytes, the last id's logits if kept with it)
        self._entries: OrderedDict[tuple[int, ...], tuple[StateSnapshot, int, np.ndarray | None]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = PrefixStats()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _best(self, key: tuple[int, ...], leave: int = 1) -> tuple[int, ...] | None:
        best: tuple[int, ...] | None = None
        for k in self._entries:
            if (len(k) <= len(key) - leave and (best is None or len(k) > len(best))
                    and key[: len(k)] == k):
                best = k
        return best

    def peek(self, ids: Sequence[int]) -> int:
        """How many of ``ids`` :meth:`lookup` would skip (nothing counted, nothing moved)."""
        with self._lock:
            best = self._best(tuple(int(i) for i in ids))
        return 0 if best is None else len(best)

    def exact(self, ids: Sequence[int]) -> tuple[StateSnapshot, np.ndarray] | None:
        """The state kept after exactly ``ids`` with its last row's logits (the same prompt
        sent again starts from them without a pass), or ``None``."""
        key = tuple(int(i) for i in ids)
        with self._lock:
            got = self._entries.get(key)
            if got is not None and got[2] is not None:
                self._entries.move_to_end(key)
                self.stats.lookups += 1
                self.stats.hits += 1
                self.stats.cached_tokens += len(key)
                return got[0], got[2]
        if self.spill is None:
            return None
        logits = self.spill.load_logits(key)  # the logits first: a state without them is no use here
        snap = self.spill.load(key) if logits is not None else None
        if snap is None or logits is None:
            return None
        size = kept_snapshot_bytes(snap) + 4 * logits.size
        if size <= self.budget:  # back in memory
            self._keep(key, snap, size, logits)
        with self._lock:
            self.stats.lookups += 1
            self.stats.hits += 1
            self.stats.cached_tokens += len(key)
        return snap, logits

    def lookup(self, ids: Sequence[int], leave: int = 1) -> tuple[int, StateSnapshot | None]:
        """The longest kept prefix of ``ids`` that leaves at least ``leave`` ids to feed (one:
        a pass must still give logits): its length and its state (``0, None`` when none)."""
        key = tuple(int(i) for i in ids)
        with self._lock:
            self.stats.lookups += 1
            best = self._best(key, leave)
        n = 0 if best is None else len(best)
        on_disk = self.spill.best(key, leave) if self.spill is not None else 0
        if self.spill is not None and on_disk > n:
            longer = key[:on_disk]
            snap = self.spill.load(longer)
            if snap is not None:
                size = kept_snapshot_bytes(snap)
                if size <= self.budget:  # back in memory (else served from disk each time)
                    self._keep(longer, snap, size, None)
                with self._lock:
                    self.stats.hits += 1
                    self.stats.cached_tokens += len(longer)
                return len(longer), snap
        with self._lock:
            if best is None or best not in self._entries:  # (evicted meanwhile: a miss)
                return 0, None
            self._entries.move_to_end(best)
            self.stats.hits += 1
            self.stats.cached_tokens += len(best)
            return len(best), self._entries[best][0]

    def store(self, ids: Sequence[int], state: SequenceState,
              logits: np.ndarray | None = None) -> bool:
        """Keep a copy of ``state`` (which has consumed exactly ``ids``), and of ``logits``
        (its last row's) when given; False when it does not fit the budget or ``ids`` is
        empty."""
        key = tuple(int(i) for i in ids)
        if not key or state.pos != len(key) or (self.budget <= 0 and self.spill is None):
            return False
        with self._lock:
            got = self._entries.get(key)
            if got is not None and (logits is None or got[2] is not None):
                self._entries.move_to_end(key)
                return True
        size = kept_bytes(state) + (0 if logits is None else 4 * logits.size)
        if size > self.budget:  # never kept in memory: nothing copied (the disk may take it)
            return self.spill is not None and self.spill.put(key, snapshot(state), logits)
        snap = snapshot(state)
        kept = None if logits is None else np.array(logits, dtype=np.float32, copy=True)
        self._keep(key, snap, size, kept)
        return True

    def _keep(self, key: tuple[int, ...], snap: StateSnapshot, size: int,
              logits: np.ndarray | None) -> None:
        """Hold ``snap`` under ``key``; what the budget evicts goes to the spill, if any."""
        gone: list[tuple[tuple[int, ...], StateSnapshot, np.ndarray | None]] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._bytes + size > self.budget and self._entries:
                k, (s, n, lg) = self._entries.popitem(last=False)
                self._bytes -= n
                self.stats.evicted += 1
                gone.append((k, s, lg))
            self._entries[key] = (snap, size, logits)
            self._bytes += size
            self.stats.stored += 1
        if self.spill is not None:  # written outside the lock: other requests go on
            for k, s, lg in gone:
                self.spill.put(k, s, lg)

    def to_json(self) -> dict[str, object]:
        s = self.stats
        out: dict[str, object] = {
            "entries": len(self), "bytes": self._bytes, "budget": self.budget,
            "lookups": s.lookups, "hits": s.hits, "cached_tokens": s.cached_tokens,
            "evicted": s.evicted}
        if self.spill is not None:
            out["disk"] = self.spill.to_json()
        return out
