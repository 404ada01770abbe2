"""One engine, one resident session, one generation at a time.

The server's engine is opened once. A :class:`Worker` keeps one resident sequence: the ids
its state has consumed and the logits after the last of them. A job whose prompt extends
those ids continues the state, feeding only the new ids; any other prompt starts a fresh
state. Incremental decoding gives the same logits as a fresh run over the whole prompt, so
the reused path is bit-identical to a fresh one (``tests/serve`` checks it against the
Python API). The decode loop is :func:`k3core.model.generate.generate`'s: the prompt once,
then each generated id, stopping after a stop id or ``max_tokens``; the last id picked is
not fed until the next job continues the sequence.

Jobs run on the caller's thread; the app runs them on one dedicated thread, in arrival
order. A job is cancelled between two tokens (its client went away): the sequence stays
valid up to the ids it fed, so the next job can still continue it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from k3core.api.errors import UsageError
from k3core.model.sampling import Sampler, argmax
from k3core.model.state import SequenceState
from k3core.run.engine import Engine


@dataclass(eq=False)
class Job:
    """One generation: the whole prompt (not just its new part) and how to decode."""

    prompt_ids: list[int]
    max_tokens: int
    sampler: Sampler | None = None
    stop_ids: frozenset[int] = frozenset()
    #: called with each generated id; return False to end the job (a stop string hit)
    on_token: Callable[[int], bool] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    ids: list[int]
    finish: str  # "stop" (stop id or stop string), "length" (max_tokens), "cancelled"
    reused: int  # prompt ids the resident state already held
    seconds: float


class Resident:
    """The carried state of one sequence: the ids it consumed and the logits after them."""

    def __init__(self, engine: Engine, capacity: int):
        self.engine = engine
        self.capacity = capacity
        self.state: SequenceState | None = None
        self.fed: list[int] = []
        self.logits: np.ndarray | None = None

    def reset(self) -> None:
        self.state, self.fed, self.logits = None, [], None

    def reusable(self, ids: list[int]) -> int:
        """How many of ``ids`` the state already holds (0 unless it can continue them)."""
        n = len(self.fed)
        if self.state is None or n == 0 or n > len(ids) or ids[:n] != self.fed:
            return 0
        if n == len(ids) and self.logits is None:
            return 0
        return n

    def feed(self, ids: list[int]) -> np.ndarray:
        if self.state is None:
            self.state = SequenceState(self.engine.cfg, self.capacity)
        try:
            logits = self.engine.model.forward(np.array(ids), self.state)[-1]
        except BaseException:
            self.reset()  # a failed pass may have changed the recurrent state in place
            raise
        self.fed += ids
        self.logits = logits
        return logits


class Worker:
    """Runs jobs on one engine, continuing the resident sequence when it can."""

    def __init__(self, engine: Engine, context: int):
        self.engine = engine
        self.context = context
        self.resident = Resident(engine, context)
        self.lock = threading.Lock()
        self.jobs_done = 0

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.context:
            raise UsageError(
                f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: {n_prompt + max_tokens} "
                f"is over the context of {self.context} tokens")

    def run(self, job: Job) -> Outcome:
        with self.lock:
            return self._run(job)

    def _run(self, job: Job) -> Outcome:
        t0 = time.perf_counter()
        if not job.prompt_ids:
            raise UsageError("the prompt is empty: nothing to feed the model")
        self.check_fits(len(job.prompt_ids), job.max_tokens)
        out: list[int] = []
        if job.cancel.is_set():
            return Outcome(out, "cancelled", 0, 0.0)
        res = self.resident
        reused = res.reusable(job.prompt_ids)
        if reused == 0:
            res.reset()
        new = job.prompt_ids[reused:]
        logits = res.feed(new) if new else res.logits
        assert logits is not None
        pick = job.sampler or argmax
        finish = "length"
        for g in range(job.max_tokens):
            if job.cancel.is_set():
                finish = "cancelled"
                break
            if g:
                logits = res.feed([out[-1]])
            tok = int(pick(logits))
            out.append(tok)
            go_on = job.on_token(tok) if job.on_token is not None else True
            if tok in job.stop_ids or go_on is False:
                finish = "stop"
                break
        self.jobs_done += 1
        return Outcome(out, finish, reused, time.perf_counter() - t0)
