"""The router lookahead's guessed reads in the expert cache (docs/expert-cache.md, "Router
lookahead").

A guess names experts of a later layer (the model applies that layer's router to an
approximation of its input). :class:`GuessedReads` reads the guessed experts that are not
resident at low priority: after every real read already queued, into a free slot or a slot
the policy gives up among keys that are neither in use (the visit being served, another
guess still reading) nor due this step (a layer later than the one being served), and at
most half the slots hold guesses not yet requested (the real requests keep room). When the
real request of that layer arrives, a guessed read it wants is adopted (:meth:`claim`: the
cache waits for it like its own read), one it does not want is cancelled if it has not
started (its slot goes back EMPTY), else it completes and stays as an ordinary resident
expert. A guess never decides what is computed: the real router does, so the bits never
change. A guess whose read fails is simply dropped (the real request, if any, reads the
expert itself).

The cache keeps its slots; this module only asks for them through :class:`GuessSlots`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from k3core.api.cache_policy import key_expert, make_key
from k3core.experts.locator import ExpertRef

#: the lookahead counters in ``stats.extra`` (docs/expert-cache.md, "Router lookahead")
LOOKAHEAD_COUNTERS = ("lookahead_layers", "lookahead_guessed", "lookahead_resident",
                      "lookahead_reads", "lookahead_skipped", "lookahead_used",
                      "lookahead_cancelled", "lookahead_failed", "lookahead_bytes",
                      "lookahead_wasted_bytes", "lookahead_real", "lookahead_recalled")


class GuessSlots(Protocol):
    """What the guessed reads need of the cache: its slots, never its batches."""

    capacity: int
    step: int

    def is_resident(self, key: int) -> bool:
        """``key`` holds a slot (its bytes resident or being read)."""

    def kept_from(self, layer: int) -> set[int]:
        """Keys a guess for ``layer`` must not evict: in use by the visit being served, or
        due this step (resident keys of ``layer`` or a later one)."""

    def guess_ref(self, layer: int, expert: int) -> ExpertRef | None:
        """Where the expert's bytes are, or ``None`` when it is larger than a slot."""

    def reserve_guess(self, key: int, keep: set[int]) -> int | None:
        """A slot for ``key`` (a free one, else the policy's victim outside ``keep``),
        placed without being announced as a request; ``None`` when there is none."""

    def read_slot(self, ref: ExpertRef, slot: int) -> float:
        """Read ``ref`` into ``slot`` (on a reader thread); the seconds it took."""

    def submit_read(self, fn: Callable[[ExpertRef, int], float], ref: ExpertRef,
                    slot: int) -> Future[float]:
        """Queue ``fn(ref, slot)`` on the reader threads, after every read already queued."""

    def publish(self, key: int, step: int) -> None:
        """``key``'s slot holds its bytes since ``step``."""

    def release(self, key: int, slot: int) -> None:
        """``key``'s slot goes back EMPTY (the policy hears ``on_evict``)."""


@dataclass
class Guess:
    """A guessed expert's read into a reserved slot, not yet published."""

    layer: int
    ref: ExpertRef
    slot: int
    future: Future[float]
    step: int
    wanted: bool | None = None  # None: its layer's real request has not arrived yet


class GuessedReads:
    """The guesses of one expert cache: their reads, their fate, their counters (kept in
    ``counts``, the cache's ``stats.extra``)."""

    def __init__(self, slots: GuessSlots, counts: dict[str, float],
                 recorder: object | None = None):
        self.slots = slots
        self.counts = counts
        counts.update(dict.fromkeys(LOOKAHEAD_COUNTERS, 0))
        self.recorder = recorder
        self.pending: dict[int, Guess] = {}  # key -> guessed read not yet published
        self._guessed: dict[int, set[int]] = {}  # layer -> experts of its last guess
        self._lock = threading.Lock()

    def keys(self) -> set[int]:
        """The keys of the guessed reads not yet published (never evicted meanwhile)."""
        return set(self.pending)

    def guess(self, layer: int, guess: Sequence[int]) -> None:
        """Read the experts of ``guess`` (for ``layer``, a layer not yet served this step)
        that are not resident, at low priority (see the module docstring)."""
        self.settle()
        experts = list(dict.fromkeys(int(e) for e in guess))
        self._guessed[layer] = set(experts)
        if self.recorder is not None:
            self.recorder.record_guess(layer, experts)  # type: ignore[attr-defined]
        x, s = self.counts, self.slots
        x["lookahead_layers"] += 1
        x["lookahead_guessed"] += len(experts)
        keep: set[int] | None = None
        for e in experts:
            key = make_key(layer, e)
            if s.is_resident(key):
                x["lookahead_resident"] += 1
                continue
            if len(self.pending) >= s.capacity // 2:  # leave the real requests room
                x["lookahead_skipped"] += 1
                continue
            ref = s.guess_ref(layer, e)
            if ref is None:
                continue
            if keep is None:
                keep = s.kept_from(layer) | set(self.pending)
            slot = s.reserve_guess(key, keep)
            if slot is None:
                x["lookahead_skipped"] += 1
                continue
            keep.add(key)
            fut = s.submit_read(self._read, ref, slot)
            self.pending[key] = Guess(layer, ref, slot, fut, s.step)
            x["lookahead_reads"] += 1

    def _read(self, ref: ExpertRef, slot: int) -> float:
        dt = self.slots.read_slot(ref, slot)
        with self._lock:
            self.counts["lookahead_bytes"] += ref.nbytes
        return dt

    def claim(self, key: int) -> Guess | None:
        """The real request wants ``key``: its guessed read to adopt (still reading, or
        done), or ``None`` (no guess; or one never read or failed, whose slot went back
        EMPTY so the request reads the expert itself)."""
        g = self.pending.pop(key, None)
        if g is None:
            return None
        if g.future.cancelled() or (g.future.done() and g.future.exception() is not None):
            self.slots.release(key, g.slot)
            return None
        self.counts["lookahead_used"] += 1
        return g

    def resolve(self, layer: int, wanted: set[int]) -> None:
        """The real request of ``layer`` arrived (``wanted``: its keys): score the guess,
        drop what it does not want."""
        guessed = self._guessed.pop(layer, None)
        if guessed is not None:
            real = {key_expert(k) for k in wanted}
            self.counts["lookahead_real"] += len(real)
            self.counts["lookahead_recalled"] += len(real & guessed)
        for key, g in list(self.pending.items()):
            if g.wanted is None and (g.layer != layer or key not in wanted):
                self._unwanted(key, g)
        self.settle()

    def settle(self, final: bool = False) -> None:
        """Publish unwanted guessed reads that completed (``final``: a new step; every guess
        not yet requested is unwanted, and every read is waited for)."""
        for key, g in list(self.pending.items()):
            if final and g.wanted is None and self._unwanted(key, g):
                continue
            if g.wanted is not False or not (final or g.future.done()):
                continue
            del self.pending[key]
            try:
                g.future.result()
            except Exception:  # a failed guess is only a guess: its slot goes back EMPTY
                self.slots.release(key, g.slot)
                self.counts["lookahead_failed"] += 1
            else:
                self.slots.publish(key, g.step)

    def _unwanted(self, key: int, g: Guess) -> bool:
        """Mark ``g`` unwanted: cancelled if its read has not started (True), else its
        bytes count as wasted."""
        g.wanted = False
        if g.future.cancel():
            del self.pending[key]
            self.slots.release(key, g.slot)
            self.counts["lookahead_cancelled"] += 1
            return True
        self.counts["lookahead_wasted_bytes"] += g.ref.nbytes
        return False

    def clear(self) -> None:
        self.pending.clear()
