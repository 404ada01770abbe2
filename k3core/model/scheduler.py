"""The scheduler: every forward pass of a model goes through it, batched across sequences.

One model serves many sequences (a server's clients, the threads of a Python program, a
batch file's prompts). Each sequence's decode loop (:mod:`k3core.model.decode`) asks for its
next pass with :meth:`Scheduler.forward`, a :class:`~k3core.model.segments.Feed`: the ids to
feed after its state, how many trailing rows' logits it wants. The call blocks until a pass
holding it has run. Passes are made by whichever waiting caller finds the model idle (no
thread of its own: a lone run's passes run on its own thread, exactly as a plain call, Ctrl-C
included). That caller, the *leader*, first gives the other running sequences a moment to
ask, then takes every waiting feed in arrival order and runs them as one pass
(:meth:`k3core.model.forward.Model.forward_many`); how many sequences run at once is the
callers' to bound (a server's slots, ``generate_batch``'s ``max_batch``).

A running sequence is a thread inside :meth:`Scheduler.running` (nested registrations of
one thread are one sequence). Between two passes each is sampling its token, handing it to
its client, checking its stops: a few milliseconds of Python, more when many threads share
the interpreter. The leader waits for every running sequence that is not *idle* to ask, for
at most :data:`GATHER_SECONDS` or :data:`GATHER_SHARE` of the last pass's seconds, whichever
is longer (capped at :data:`GATHER_MOST`): a fixed 20 ms window on a 2-core machine whose
passes take a second cut eight streams into two groups whose passes then alternated, every
token waiting for the other group's pass. A sequence that lets a whole gather run out
without asking (a stream its caller stopped reading) is idle: not waited for until it asks
again, so an abandoned stream costs one gather, not one a pass. And a pass that would hold
only newcomers, on a model where no running sequence has had a pass yet (a burst of
requests on an idle server), waits :data:`ARRIVAL_SHARE` of the last pass's seconds
(:data:`ARRIVAL_MOST` at most) for more to arrive: eight requests sent at once reach the
scheduler over some 20 ms, and the first no longer takes the model alone while the other
seven wait for its whole prompt pass (on the medium model streamed, 1.3 s added to their
first token).

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

#: the least a leader waits for the other running sequences to ask for their next pass
GATHER_SECONDS = 0.02
#: ... and the share of the last pass's wall seconds it waits at most, when that is longer
GATHER_SHARE = 0.1
#: ... never longer than this
GATHER_MOST = 0.25
#: a pass that would hold only sequences that have had no pass yet, on a model with no
#: generation running, waits this share of the last pass's seconds for more to arrive
ARRIVAL_SHARE = 0.05
#: ... never longer than this
ARRIVAL_MOST = 0.05
#: the most ids a sequence feeds in one pass while other sequences share it (a lone
#: sequence's prompt takes the model's ``prefill_chunk``)
INTERLEAVE_CHUNK = 64


class Cancelled(K3Error):
    """A feed whose caller cancelled it before its last pass (its state is dropped)."""


@dataclass
class _Member:
    """A running sequence: a thread inside :meth:`Scheduler.running`."""

    depth: int = 0  # nested registrations of the thread
    asking: bool = False  # inside forward: its feed is waiting or in a pass
    stepped: bool = False  # has had a pass
    idle: bool = False  # let a whole gather run out without asking: not waited for


@dataclass(eq=False)
class Ticket:
    """One caller's feed, fed over one pass or more."""

    feed: Feed
    cancel: threading.Event | None = None
    member: _Member | None = None  # the running sequence that asked (None: a bare call)
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
        self.share = GATHER_SHARE
        self.stats = BatchStats()
        self._cv = threading.Condition()
        self._waiting: list[Ticket] = []
        self._running = False
        #: the running sequences by thread (they will ask again soon)
        self._members: dict[int, _Member] = {}
        self._last_pass = 0.0  # wall seconds of the last pass

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
        me = threading.get_ident()
        with self._cv:
            m = self._members.setdefault(me, _Member())
            m.depth += 1
        try:
            yield
        finally:
            with self._cv:
                m.depth -= 1
                if not m.depth:
                    del self._members[me]
                self._cv.notify_all()

    @property
    def active(self) -> int:
        """The running sequences."""
        return len(self._members)

    def gather_seconds(self) -> float:
        """How long the next leader waits at most for the running sequences to ask."""
        return max(self.gather, min(GATHER_MOST, self.share * self._last_pass))

    def arrival_seconds(self) -> float:
        """How long a leader waits for newcomers when nothing has been generating."""
        return min(ARRIVAL_MOST, ARRIVAL_SHARE * self._last_pass)

    def _arriving(self) -> bool:
        """Only newcomers are waiting, and no running sequence has had a pass (a burst of
        requests on an idle model: the first to ask should not take the model alone)."""
        return bool(self._waiting) and all(
            t.member is not None and not t.member.stepped for t in self._waiting) and not any(
            m.stepped for m in self._members.values())

    def _absent(self) -> list[_Member]:
        """Running sequences neither asking nor idle: the ones a leader waits for."""
        return [m for m in self._members.values() if not (m.asking or m.idle)]

    # ---- passes ----------------------------------------------------------------------------
    def forward(self, feed: Feed, cancel: threading.Event | None = None) -> np.ndarray:
        """``feed``'s logits (its last ``rows`` rows), after the pass(es) that hold it: the
        bytes a pass of its own gives (non-finite logits refused). ``cancel`` set before its
        last pass ends it with :class:`Cancelled` (between two chunks of a long prompt: a
        client that went away)."""
        feed.state.check_room(len(feed.ids))
        if not len(feed.ids):
            return np.empty((0, self.model.cfg.vocab), dtype=np.float32)
        with self._cv:
            me = self._members.get(threading.get_ident())
            t = Ticket(feed, cancel, me)
            if me is not None:
                me.asking, me.idle = True, False
            self._waiting.append(t)
            self._cv.notify_all()
            try:
                self._until_done(t)
            finally:
                if me is not None:
                    me.asking = False
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
            arriving = self._arriving()
            limit = self.arrival_seconds() if arriving else self.gather_seconds()
            while not t.done and not self._running and (arriving or self._absent()):
                left = limit - (time.monotonic() - first)
                if left <= 0:
                    break
                self._cv.wait(left)
            if t.done or self._running:
                continue
            for m in self._absent():  # the gather ran out: not waited for until they ask
                m.idle = True
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
        alone = len(batch) == 1 and len(self._members) <= 1
        budget = self.model.prefill_chunk if alone else self.chunk
        feeds = []
        for t in batch:
            f, m = t.feed, t.left
            if budget is not None and budget > 0:
                m = min(m, budget)
            end = t.fed + m
            asked = max(0, min(m, end - (len(f.ids) - f.rows)))
            feeds.append(Feed(f.ids[t.fed : end], f.state, asked))
        t0 = time.monotonic()
        try:
            outs = self.model.forward_many(feeds, new_step=any(t.fed == 0 for t in batch))
        except BaseException as e:
            with self._cv:
                for t in batch:
                    t.error = e if t is mine or isinstance(e, Exception) else K3Error(
                        "the batched pass this sequence was in was interrupted")
                    self._finish(t)
            return
        with self._cv:
            self._last_pass = time.monotonic() - t0
            self.stats.record(len(feeds), sum(len(f.ids) for f in feeds))
            for t, f, out in zip(batch, feeds, outs, strict=True):
                if t.member is not None:
                    t.member.stepped = True
                t.fed += len(f.ids)
                t.passes += 1
                if out.shape[0] or not t.outs:
                    t.outs.append(out)
                if not t.left:
                    self._finish(t)

    def _finish(self, t: Ticket) -> None:
        """``t`` is done (the lock held). Its sequence counts as between two passes from now,
        not from when its thread next runs: a leader that ran the pass and asks again at
        once waits for the others, instead of finding them still asking and leading alone."""
        t.done = True
        self._waiting.remove(t)
        if t.member is not None:
            t.member.asking = False
