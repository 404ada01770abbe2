"""Demand reads first: a read the forward pass waits for goes ahead of a read-ahead.

Two kinds of reads share one disk in a streamed run. A routed expert missed by the cache is
a *demand* read: the MoE cannot finish its layer until the bytes are in, so every
millisecond it spends queued behind other I/O is a millisecond of exposed wait. The trunk
ring's reader thread reads *ahead*: the part it fills is needed only when the walk reaches
it, a part or more later. Issued side by side, a 40 MB trunk read in the device queue
makes each 0.8 MB expert read behind it wait for it (measured on the synthetic medium model,
streamed at ``--trunk-gb 0.2 --cache-gb 0.2``: 27 s of device time for 4.6 GB of expert
reads, 171 MB/s per read, against a disk that reads 1.3-3 GB/s).

:data:`DEMAND` is the process's gate. A demand read counts from :meth:`ReadPriority.begin`
at its submission to :meth:`ReadPriority.end` when its future is done, so a read still queued
for a reader thread counts too. A read-ahead cuts its read into pieces
(:data:`AHEAD_PIECE_BYTES`) and calls :meth:`ReadPriority.wait_for_demand` before each,
which returns at once when at most :data:`LAST_DEMAND` demand read is in flight and
otherwise waits until so, but never longer than its timeout (a demand read stuck in the
kernel must not stall the ring). The read-ahead goes beside the *last* demand read rather
than after it: waking the read-ahead thread takes 0.1-0.5 ms, in which the disk had nothing
to do, once a layer (measured on the medium model's ``bp-nib`` trunk streamed at
``--trunk-gb 0.2 --cache-gb 0.2``: three alternating pairs of 16-token runs, 0.426-0.438 s
a token against 0.436-0.444 waiting for none, the disk's rate while busy 1.97-2.02 GB/s
against 1.94-1.98). Only the order of reads changes, never their bytes: the bits of a run
cannot depend on it.
"""

from __future__ import annotations

import threading
import time

#: a read-ahead's piece: one syscall between two looks at the gate (8 MiB is 2-6 ms of a
#: 1.3-4 GB/s disk, the most a demand read waits for read-ahead already in flight; 4, 16 and
#: 32 MiB measured the same within the noise on the streamed medium model)
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
