"""The scheduler: every forward pass of a model goes through it, batched across sequences.

One model serves many sequences (a server's clients, the threads of a Python program, a
batch file's prompts). Each sequence's decode loop (:mod:`k3core.model.decode`) asks for its
next pass with :meth:`Scheduler.forward`, a :class:`~k3core.model.segments.Feed`: the ids to
feed after its state, how many trailing rows' logits it wants. The call blocks until a pass
holding it has run. Passes are made by whichever waiting caller finds the model idle (no
thread of its own: a lone run's passes run on its own thread, exactly as a plain call, Ctrl-C
included). That caller, the *leader*, first gives the other running sequences a moment to
ask (:data:`GATHER_SECONDS` at most: each is between two tokens, a few microseconds of
Python), then takes every waiting feed in arrival order and runs them as one pass
(:meth:`k3core.model.forward.Model.forward_many`); how many sequences run at once is the
callers' to bound (a server's slots, ``generate_batch``'s ``max_batch``). Sequences that let a whole gather
pass without asking (a stream its caller stopped reading) are not waited for again until a
sequence enters or leaves.

A feed longer than the pass budget (a newcomer's prompt while others decode) is fed in
chunks of at most ``chunk`` ids, one chunk a pass, beside the running rows' steps: their
streams keep flowing while the prompt comes in. A lone sequence takes the model's own
``prefill_chunk`` (none: one pass), as before batching.

**Bits.** Every product is bit-identical row by row, the experts' outputs are per row, and
attention and the recurrence run per sequence on its own state, so a feed's logits are the
bytes it gets alone, whatever else shares its pass and however its ids are chunked
(``tests/model/test_batched_step.py``). A pass that fails (a read error, Ctrl-C) fails every
feed in it: each of their states may have advanced in some layers, and each loop drops its
state as it does for a lone pass.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from k3core.api.errors import K3Error
from k3core.model.config import ModelConfig
from k3core.model.segments import Feed, checked


class PassRunner(Protocol):
    """What the scheduler needs of a model (:class:`k3core.model.forward.Model`)."""

    cfg: ModelConfig
    prefill_chunk: int | None
    chunks_last: int

    def forward_many(self, feeds: list[Feed], new_step: bool = True) -> list[np.ndarray]: ...

#: how long a leader waits for the other running sequences to ask for their next pass
GATHER_SECONDS = 0.02
#: the most ids a sequence feeds in one pass while other sequences share it (a lone
#: sequence's prompt takes the model's ``prefill_chunk``)
INTERLEAVE_CHUNK = 64


class Cancelled(K3Error):
    """A feed whose caller cancelled it before its last pass (its state is dropped)."""


@dataclass(eq=False)
class Ticket:
    """One caller's feed, fed over one pass or more."""

    feed: Feed
    cancel: threading.Event | None = None
    fed: int = 0
    outs: list[np.ndarray] = field(default_factory=list)
    passes: int = 0
    done: bool = False
    error: BaseException | None = None

    @property
    def left(self) -> int:
        return len(self.feed.ids) - self.fed


@dataclass
class BatchStats:
    """What the scheduler did: passes, rows, the largest batch, the batch of the last pass."""

    passes: int = 0
    rows: int = 0
    feeds: int = 0
    most: int = 0
    last: int = 0

    def record(self, feeds: int, rows: int) -> None:
        self.passes += 1
        self.feeds += feeds
        self.rows += rows
        self.most = max(self.most, feeds)
        self.last = feeds


class Scheduler:
    """Batches the passes of the sequences that run on ``model`` (see the module)."""

    def __init__(self, model: PassRunner,
                 chunk: int = INTERLEAVE_CHUNK, gather: float = GATHER_SECONDS):
        self._model = weakref.ref(model)  # the model holds its scheduler: no cycle back
        self.chunk = chunk
        self.gather = gather
        self.stats = BatchStats()
        self._cv = threading.Condition()
        self._waiting: list[Ticket] = []
        self._running = False
        self._active = 0  # sequences inside a decode loop (they will ask again soon)
        #: running sequences that let a whole gather pass without asking (an abandoned
        #: stream): not waited for again until a sequence enters or leaves
        self._idle = 0

    @property
    def model(self) -> PassRunner:
        m = self._model()
        if m is None:
            raise K3Error("the model of this scheduler is gone")
        return m

    # ---- the sequences ------------------------------------------------------------------------
    @contextmanager
    def running(self) -> Iterator[None]:
        """Count a sequence as running while its decode loop is inside: the leader of a pass
        waits (briefly) for every running sequence to ask."""
        with self._cv:
            self._active += 1
            self._idle = 0
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._idle = 0
                self._cv.notify_all()

    @property
    def active(self) -> int:
        return self._active

    # ---- passes ----------------------------------------------------------------------------
    def forward(self, feed: Feed, cancel: threading.Event | None = None) -> np.ndarray:
        """``feed``'s logits (its last ``rows`` rows), after the pass(es) that hold it: the
        bytes a pass of its own gives (non-finite logits refused). ``cancel`` set before its
        last pass ends it with :class:`Cancelled` (between two chunks of a long prompt: a
        client that went away)."""
        feed.state.check_room(len(feed.ids))
        t = Ticket(feed, cancel)
        if not len(feed.ids):
            return np.empty((0, self.model.cfg.vocab), dtype=np.float32)
        with self._cv:
            self._waiting.append(t)
            self._cv.notify_all()
            try:
                self._until_done(t)
            finally:
                if not t.done:  # interrupted while waiting: the ticket leaves the queue
                    t.done = True
                    if t in self._waiting:
                        self._waiting.remove(t)
        if t.error is not None:
            raise t.error
        out = t.outs[0] if len(t.outs) == 1 else np.concatenate(t.outs)
        self.model.chunks_last = t.passes
        return checked(out)

    def _until_done(self, t: Ticket) -> None:
        """Wait for ``t``'s passes, leading one whenever the model is idle (the lock held)."""
        while not t.done:
            if self._running:
                self._cv.wait()
                continue
            first = time.monotonic()
            while (not t.done and not self._running
                   and len(self._waiting) < self._active - self._idle
                   and time.monotonic() - first < self.gather):
                self._cv.wait(self.gather / 4)
            if t.done or self._running:
                continue
            if len(self._waiting) < self._active - self._idle:  # the gather ran out
                self._idle = self._active - len(self._waiting)
            batch = self._take()
            if not batch:
                continue
            self._running = True
            self._cv.release()
            try:
                self._run(batch, t)
            finally:
                self._cv.acquire()
                self._running = False
                self._cv.notify_all()

    def _take(self) -> list[Ticket]:
        """The feeds of the next pass, in arrival order (the lock held); cancelled ones leave."""
        for t in [t for t in self._waiting if t.cancel is not None and t.cancel.is_set()]:
            t.error, t.done = Cancelled("cancelled"), True
            self._waiting.remove(t)
        return list(self._waiting)  # (how many run at once is the callers': a server's slots)

    def _run(self, batch: list[Ticket], mine: Ticket) -> None:
        """One pass over a slice of each ticket's ids (the lock not held); tickets fed whole
        are done. A failed pass fails every ticket in it: ``mine`` (the leader's) with the
        error itself, the others with it too unless it is not an ``Exception`` (Ctrl-C,
        which belongs to the leader's thread)."""
        alone = len(batch) == 1 and self._active <= 1
        budget = self.model.prefill_chunk if alone else self.chunk
        feeds = []
        for t in batch:
            f, m = t.feed, t.left
            if budget is not None and budget > 0:
                m = min(m, budget)
            end = t.fed + m
            asked = max(0, min(m, end - (len(f.ids) - f.rows)))
            feeds.append(Feed(f.ids[t.fed : end], f.state, asked))
        try:
            outs = self.model.forward_many(feeds, new_step=any(t.fed == 0 for t in batch))
        except BaseException as e:
            with self._cv:
                for t in batch:
                    t.error = e if t is mine or isinstance(e, Exception) else K3Error(
                        "the batched pass this sequence was in was interrupted")
                    t.done = True
                    self._waiting.remove(t)
            return
        with self._cv:
            self.stats.record(len(feeds), sum(len(f.ids) for f in feeds))
            for t, f, out in zip(batch, feeds, outs, strict=True):
                t.fed += len(f.ids)
                t.passes += 1
                if out.shape[0] or not t.outs:
                    t.outs.append(out)
                if not t.left:
                    t.done = True
                    self._waiting.remove(t)
