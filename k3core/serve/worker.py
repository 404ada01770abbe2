"""One engine, one resident session, one generation at a time.

The server's engine is opened once and holds one :class:`~k3core.run.session.Session`. A job
whose prompt extends the ids that session's state has consumed continues it, feeding only
the new ids; any other prompt starts the session afresh. A session split into calls gives
the same ids and logit bytes as one run over the whole prompt, so the reused path is
bit-identical to a fresh one (``tests/serve`` checks both). The session's last generated id
is *pending* (not yet fed): a prompt that continues with another id (a chat client that sends
back ``<|end_of_msg|>`` where the model wrote ``[EOS]``) still reuses everything before it.

A job of ``n`` rows (OpenAI's ``n``) prefills its prompt but the last id once, keeps a copy
of that state (:func:`~k3core.model.state.snapshot`), and decodes the rows one after the
other, each from the copy restored, fed the last prompt id, with its own seed: row ``i``
draws with ``(seed + i) mod 2**63`` (:func:`row_params`). A split of a sequence into calls
gives the bytes of one pass, so each row is exactly the single request with its seed. A job
that wants the prompt's logprobs (``on_prompt_rows``) prefills the same way, from a fresh
session (the positions a reused state holds have no logits left), and is handed every
prompt position's logits.

Jobs run on the caller's thread; the app runs them on one dedicated thread, in arrival order.
A job is cancelled between two tokens (its client went away): the session stays valid up to
the ids it fed, so the next job may still continue it. A failure inside a forward pass drops
the session (its recurrent state may have been changed in place).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.api.errors import UsageError
from k3core.model.constraint import Constraint
from k3core.model.generate import Step
from k3core.model.state import restore, snapshot
from k3core.run.engine import Engine
from k3core.run.request import GenerationParams
from k3core.run.session import PickWrap

#: called with each step (``None`` for text released at the end) and its text piece; return
#: False to end the job
OnStep = Callable[[Step | None, str], bool]


#: the seeds a request may give are below this; row seeds wrap around it
SEED_LIMIT = 1 << 63


@dataclass(eq=False)
class Job:
    """One generation: the whole prompt (not just its new part) and how to decode it.

    ``n`` rows are decoded one after the other; ``row`` is the one running (``on_step`` is
    called for every row's steps). ``around(row)`` may wrap each row's pick
    (``Session.steps``); ``on_prompt_rows(pos, rows)`` is handed the logits of every prompt
    position but the last (``Session.prefill``); ``constraint(row)`` gives each row its own
    constraint (a JSON reply, a forced tool call: ``k3core.model.constraint``)."""

    prompt_ids: list[int]
    params: GenerationParams
    on_step: OnStep | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    n: int = 1
    around: Callable[[int], PickWrap | None] | None = None
    on_prompt_rows: Callable[[int, np.ndarray], None] | None = None
    row: int = 0
    constraint: Callable[[int], Constraint | None] | None = None


@dataclass
class Row:
    """One row of a job: its ids, how it ended (as :class:`Outcome`), its seed."""

    ids: list[int]
    finish: str
    seed: int | None = None


@dataclass
class Outcome:
    ids: list[int]  # every row's ids, row after row (one row: its ids)
    finish: str  # "stop" (stop id, end of sequence or stop string), "length", "cancelled"
    reused: int  # prompt ids the resident state already held
    seconds: float
    seed: int | None = None  # the first row's
    rows: list[Row] = field(default_factory=list)


def row_params(params: GenerationParams, row: int) -> GenerationParams:
    """Row ``row``'s parameters: its seed ``(seed + row) mod 2**63`` (greedy rows, and any
    without a seed, as given)."""
    if row == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": (params.seed + row) % SEED_LIMIT})


class Worker:
    """Runs jobs on one engine's resident session, continuing it when it can."""

    def __init__(self, engine: Engine, context: int):
        self.engine = engine
        self.context = context
        self.session = engine.session(incremental=True)
        self.lock = threading.Lock()
        self.jobs_done = 0
        self.cancelled = 0
        self.last: dict[str, Any] = {}

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.context:
            raise UsageError(
                f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: "
                f"{n_prompt + max_tokens} is over the context of {self.context} tokens")

    def reusable(self, ids: list[int]) -> int:
        """How many of ``ids`` the resident state holds and can continue from."""
        s = self.session
        n = s.positions
        return n if n and len(ids) > n and ids[:n] == s.ids[:n] else 0

    def run(self, job: Job) -> Outcome:
        with self.lock:
            out = self._run(job)
        self.jobs_done += 1
        self.cancelled += out.finish == "cancelled"
        self.last = {"finish": out.finish, "completion_tokens": len(out.ids), "reused_tokens": out.reused}
        return out

    def _run(self, job: Job) -> Outcome:
        t0 = time.perf_counter()
        if not job.prompt_ids:
            raise UsageError("the prompt is empty: nothing to feed the model")
        self.check_fits(len(job.prompt_ids), job.params.max_tokens)
        if job.cancel.is_set():
            return Outcome([], "cancelled", 0, 0.0)
        s = self.session
        reused = 0 if job.on_prompt_rows is not None else self.reusable(job.prompt_ids)
        if reused:
            s.ids = s.ids[:reused]  # a pending id the prompt does not continue with is dropped
        else:
            s.reset()
        params = job.params
        if job.n == 1 and job.on_prompt_rows is None:
            rows = [self._row(job, 0, job.prompt_ids[reused:], params)]
        else:
            if job.n > 1 and not params.greedy and params.seed is None:  # one seed for all rows
                params = params.model_copy(update={"seed": time.time_ns() % SEED_LIMIT})
            head, last = job.prompt_ids[:-1], job.prompt_ids[-1:]
            try:
                s.prefill(head[reused:], job.on_prompt_rows)
            except BaseException:
                s.reset()
                raise
            snap = snapshot(s.state) if s.state is not None and s.state.pos else None
            rows = []
            for i in range(job.n):
                if i:
                    if snap is None:
                        s.reset()
                    else:
                        assert s.state is not None
                        restore(s.state, snap)
                        s.ids = list(head)
                rows.append(self._row(job, i, last, row_params(params, i)))
                if rows[-1].finish == "cancelled":
                    break
        finish = ("cancelled" if any(r.finish == "cancelled" for r in rows)
                  else "length" if any(r.finish == "length" for r in rows) else "stop")
        return Outcome([t for r in rows for t in r.ids], finish, reused,
                       time.perf_counter() - t0, rows[0].seed, rows)

    def _row(self, job: Job, row: int, feed: list[int], params: GenerationParams) -> Row:
        """Decode one row after ``feed`` (the session holds the rest of the prompt)."""
        s = self.session
        job.row = row
        around = job.around(row) if job.around is not None else None
        out: list[int] = []
        finish = "length"
        constraint = job.constraint(row) if job.constraint is not None else None
        steps = s.steps(feed, params, around, constraint)
        try:
            for step, piece in steps:
                if step is not None:
                    out.append(step.token)
                go_on = job.on_step(step, piece) if job.on_step is not None else True
                if go_on is False:
                    finish = "stop"
                    break
                if job.cancel.is_set():
                    finish = "cancelled"
                    break
        except BaseException:
            s.reset()
            raise
        finally:
            steps.close()
        gen = s.last
        if gen is not None and gen.stop_reason in ("stop_id", "eos", "stop"):
            finish = "stop"
        seed = gen.sampler.seed if gen is not None and gen.sampler is not None else None
        return Row(out, finish, seed)
