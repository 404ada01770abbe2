"""The ring's slots: which unit each holds and in what state, under one condition variable.

A slot is EMPTY, READING (a reader fills it with a unit) or READY (the unit's bytes are in
and were checked). After ``wait_ready(u)`` the *wanted* units are ``u`` and the next
``ring - 1`` streamed units in walk order (wrapping to the first for the next token); once
``u`` is released the walk is past it (it computes pinned units, or the head and the next
token's embedding, before it waits for the next streamed unit), so the window moves on by
one. :meth:`SlotRing.claim` hands a reader the nearest wanted unit not held by any slot and
a slot to read it into. Invariants:

* a slot being read into (READING) is never handed out and never chosen as a victim;
* a slot the caller holds (waited for, not yet released) is never evicted;
* a slot holding a wanted unit is never evicted, so nothing is read twice per walk; only
  the nearest missing unit may take a farther wanted unit's slot (unequal slots: the only
  one it fits may hold it);
* a unit is served only once READY; a failed read empties its slot and records the error,
  which the ``wait_ready`` of that unit raises (the next one reads it again);
* with no reader thread a unit is read on demand in ``wait_ready``, never over the slot in
  use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from k3core.api.errors import K3Error
from k3core.trunk.parts import LayerPart

EMPTY, READING, READY = "empty", "reading", "ready"
#: how long a waiting thread sleeps before it looks at the stop flag again
POLL_SECONDS = 0.25


class Slot:
    def __init__(self, index: int, buf: np.ndarray):
        self.index = index
        self.buf = buf
        self.unit: int | None = None
        self.state = EMPTY


class SlotRing:
    """Slots over ``bufs`` for the ``streamed`` units (in walk order) of ``units``."""

    def __init__(self, bufs: Sequence[np.ndarray], units: Sequence[LayerPart],
                 streamed: Sequence[int], ring: int):
        self.cond = threading.Condition()
        #: set by :meth:`close`: every loop and wait over the ring ends
        self.stop = threading.Event()
        self.slots = [Slot(i, b) for i, b in enumerate(bufs)]
        self._units = units
        self._stream = list(streamed)
        self._pos = {u: i for i, u in enumerate(self._stream)}
        self._ring = ring
        self._errors: dict[int, K3Error] = {}
        self._held: dict[int, Slot] = {}
        self._cur = -1  # the streamed unit last waited for (-1: none yet)
        self._cur_released = False  # ... and released since (the walk is past it)

    def streams(self, u: int) -> bool:
        return u in self._pos

    # ---- the caller's side -------------------------------------------------------------
    def wait_ready(self, u: int, fill: Callable[[Slot, int], None] | None) -> Slot:
        """The slot holding unit ``u`` once it is READY, held until :meth:`release`; the
        error of its failed read, raised. ``fill`` (when there is no reader thread) reads
        ``u`` on demand into a free slot, which it marks READY or empties."""
        with self.cond:
            if u in self._held:
                raise K3Error(f"trunk: layer {self._units[u].layer} acquired twice without "
                              "a release")
            self._cur = u
            self._cur_released = False
            self.cond.notify_all()
            while True:
                if self.stop.is_set():
                    raise K3Error("trunk: closed while a layer was being acquired")
                err = self._errors.pop(u, None)
                if err is not None:
                    raise err
                slot = self.slot_of(u)
                if slot is not None and slot.state == READY:
                    self._held[u] = slot
                    return slot
                if fill is not None and slot is None:
                    victim = self._victim([u], self._units[u].nbytes)
                    if victim is None:
                        raise K3Error(f"trunk: no free ring slot for layer "
                                      f"{self._units[u].layer}; release the layer in use first")
                    victim.unit, victim.state = u, READING
                    self.cond.release()
                    try:
                        fill(victim, u)
                    finally:
                        self.cond.acquire()
                    continue
                self.cond.wait(POLL_SECONDS)

    def release(self, u: int) -> None:
        with self.cond:
            self._held.pop(u, None)
            if u == self._cur:
                self._cur_released = True
            self.cond.notify_all()

    def ready_buf(self, u: int) -> np.ndarray | None:
        """The buffer of the slot holding ``u`` if it is READY now (never waits)."""
        with self.cond:
            slot = self.slot_of(u) if u in self._pos else None
            if slot is None or slot.state != READY:
                return None
            return slot.buf

    # ---- the readers' side -------------------------------------------------------------
    def claim(self) -> tuple[Slot, int] | None:
        """The nearest wanted unit no slot holds and the slot to read it into, marked
        READING, or ``None`` after a wait (nothing to read now)."""
        with self.cond:
            picked = self._next()
            if picked is None:
                self.cond.wait(POLL_SECONDS)
            return picked

    def publish(self, slot: Slot) -> None:
        """The unit read into ``slot`` is in and checked: serve it."""
        with self.cond:
            slot.state = READY
            self.cond.notify_all()

    def fail(self, slot: Slot, u: int, err: K3Error, empty: bool = True) -> None:
        """The read of ``u`` into ``slot`` failed: the ``wait_ready`` of ``u`` raises ``err``.
        The slot is emptied unless ``empty`` is false (a read still lands in it: it stays
        READING, unused)."""
        with self.cond:
            if empty:
                slot.unit, slot.state = None, EMPTY
            self._errors[u] = err
            self.cond.notify_all()

    def close(self) -> None:
        self.stop.set()
        with self.cond:
            self.cond.notify_all()

    # ---- state queries (tests and reports) ---------------------------------------------
    def states(self) -> list[tuple[int | None, str]]:
        """``(unit, state)`` of every slot."""
        with self.cond:
            return [(s.unit, s.state) for s in self.slots]

    def held_units(self) -> list[int]:
        with self.cond:
            return list(self._held)

    # ---- under the lock ------------------------------------------------------------------
    def slot_of(self, u: int) -> Slot | None:
        for s in self.slots:
            if s.unit == u and s.state != EMPTY:
                return s
        return None

    def _wanted(self) -> list[int]:
        """The held unit and the next ``ring - 1`` streamed units, nearest first (moved on
        by one once the unit last waited for is released)."""
        m = len(self._stream)
        p = self._pos[self._cur] + self._cur_released if self._cur >= 0 else 0
        return [self._stream[(p + k) % m] for k in range(min(self._ring, m))]

    def _victim(self, wanted: list[int], need: int = 0, spare: int | None = None) -> Slot | None:
        """A slot of at least ``need`` bytes to read into, the smallest that fits: an empty
        one, else a ready one neither held nor wanted (nor, when ``spare`` is given, one
        holding a wanted unit farther than ``spare``: see ``_next``)."""
        held = {id(s) for s in self._held.values()}
        fits = sorted((s for s in self.slots if s.buf.nbytes >= need), key=lambda s: s.buf.nbytes)
        for s in fits:
            if s.state == EMPTY:
                return s
        for s in fits:
            if s.state == READY and id(s) not in held and s.unit not in wanted:
                return s
        if spare is not None:
            farther = wanted[wanted.index(spare) + 1 :]
            for s in fits:
                if s.state == READY and id(s) not in held and s.unit in farther:
                    return s
        return None

    def _next(self) -> tuple[Slot, int] | None:
        wanted = self._wanted()
        for k, u in enumerate(wanted):
            if self.slot_of(u) is not None or u in self._errors:
                continue
            # the nearest unit still missing may take a farther wanted unit's slot (unequal
            # slots: the only one it fits may hold it); a farther one never evicts
            slot = self._victim(wanted, self._units[u].nbytes, spare=u if k == 0 else None)
            if slot is None:
                return None
            slot.unit, slot.state = u, READING
            return slot, u
        return None
