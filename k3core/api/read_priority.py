"""Demand reads first: a read the forward pass waits for goes ahead of a read-ahead.

Two kinds of reads share one disk in a streamed run. A routed expert missed by the cache is
a *demand* read: the MoE cannot finish its layer until the bytes are in, so every
millisecond it spends queued behind other I/O is a millisecond of exposed wait. The trunk
ring's reader thread reads *ahead*: the part it fills is needed only when the walk reaches
it, a part or more later. Issued side by side, a trunk read of tens of MB in the device
queue makes every expert read behind it wait for it.

:data:`DEMAND` is the process's gate. A demand read counts from :meth:`ReadPriority.begin`
at its submission to :meth:`ReadPriority.end` when its future is done, so a read still queued
for a reader thread counts too. A read-ahead cuts its read into pieces
(:data:`AHEAD_PIECE_BYTES`) and calls :meth:`ReadPriority.wait_for_demand` before each,
which returns at once when at most :data:`LAST_DEMAND` demand read is in flight and
otherwise waits until so, but never longer than its timeout (a demand read stuck in the
kernel must not stall the ring). The read-ahead goes beside the *last* demand read rather
than after it, so the disk is not left idle while the read-ahead thread wakes. Only the
order of reads changes, never their bytes: the bits of a run cannot depend on it. The
measurements behind these choices are in docs/measurements/2026-12-03-zen2.md and
docs/measurements/2026-12-05-zen4.md.
"""

from __future__ import annotations

import threading
import time

#: a read-ahead's piece: one syscall between two looks at the gate, and the most a demand
#: read waits for read-ahead already in flight (milliseconds of a disk of a few GB/s)
AHEAD_PIECE_BYTES = 8 << 20
#: the longest a read-ahead piece waits for demand reads before it goes anyway
AHEAD_MAX_WAIT_S = 0.05
#: the demand reads a read-ahead piece may go beside: the last one of a batch
LAST_DEMAND = 1


class ReadPriority:
    """A count of demand reads in flight, and a wait for it to reach zero."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self.waited_seconds = 0.0  # read-ahead time spent yielding

    def begin(self) -> None:
        """A demand read is submitted (queued for a reader thread, or in flight)."""
        with self._cond:
            self._active += 1

    def end(self) -> None:
        """A demand read :meth:`begin` announced has finished, failed or been cancelled."""
        with self._cond:
            self._active = max(0, self._active - 1)
            if self._active <= LAST_DEMAND:
                self._cond.notify_all()

    @property
    def active(self) -> int:
        with self._cond:
            return self._active

    def wait_for_demand(self, timeout: float = AHEAD_MAX_WAIT_S) -> float:
        """Wait until at most :data:`LAST_DEMAND` demand read is in flight, at most
        ``timeout`` seconds; the seconds waited."""
        with self._cond:
            if self._active <= LAST_DEMAND:
                return 0.0
            t0 = time.perf_counter()
            self._cond.wait_for(lambda: self._active <= LAST_DEMAND, timeout)
            dt = time.perf_counter() - t0
            self.waited_seconds += dt
            return dt


#: the process's gate: the expert cache's miss reads are demand reads, the trunk ring's reader
#: thread reads ahead
DEMAND = ReadPriority()
