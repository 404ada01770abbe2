"""One engine, many generations at once: each job a session of its own, batched by the model.

Every job runs on a thread of its own (the app's pool has ``max_batch`` of them) with a
fresh :class:`~k3core.run.session.Session`: a slot. The slots' forward passes meet in the
model's scheduler (:mod:`k3core.model.scheduler`), which runs the passes asked at once as
one batched step, so a job joins the running batch at the next step and leaves it when it
ends or its client goes away (its slot freed at once; a cancelled prompt stops between two
of its chunks). Each row's logits are the bytes of the same request run alone.

**The prefix cache** (:mod:`k3core.run.prefix_cache`). A job whose prompt starts with ids a
kept state was reached after (an earlier prompt, or an earlier prompt and its reply) starts
from that state and feeds only the rest; ``reused`` says how many ids it skipped. The state
at the end of a prompt is kept with its last row's logits after the job's first pass (the
same prompt sent again starts from them, without a pass), the state at the prompt's last
multiple of :data:`PREFIX_BLOCK` ids before its end too (requests that share an opening: a
pass of its own), and the state at the end of the reply. A split of a sequence
into calls gives the bytes of one pass, and so does a restored state.

A job of ``n`` rows (OpenAI's ``n``) prefills its prompt but the last id once, keeps a copy
of that state (:func:`~k3core.model.state.snapshot`), and decodes each row from the copy
restored, fed the last prompt id, with its own seed: row ``i`` draws with ``(seed + i) mod
2**63`` (:func:`row_params`). Each row is exactly the single request with its seed. The
rows run at once, batched like any other sequences, as far as free slots allow: every
sequence decoding holds one of the server's ``max_batch`` slots (a job waits for one before
it starts; each further row takes a free one if there is one, else it runs after the job's
other rows, on the job's own thread), so the KV caches and states the memory plan counted
are never exceeded. Each row's steps go to its own sink (``on_step`` runs on the row's
thread, ``row`` says which row that is), and ``on_row_done(row)`` follows a row's last step
unless it was cancelled. A job that wants the prompt's logprobs (``on_prompt_rows``) prefills
from a fresh state (a kept state has no logits left) and is handed every prompt position's
logits.

A job is cancelled between two tokens (its client went away). A failure inside a forward
pass fails the job; the other jobs of that pass fail with it (their states may have changed
in place), and every later job starts afresh.
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
from k3core.model.scheduler import Cancelled
from k3core.model.state import StateSnapshot, restore, snapshot
from k3core.model.steps import Step
from k3core.run.engine import Engine
from k3core.run.generation import Generation
from k3core.run.prefix_cache import PrefixCache
from k3core.run.request import GenerationParams
from k3core.run.session import PickWrap, Session

#: called with each step (``None`` for text released at the end) and its text piece; return
#: False to end the job
OnStep = Callable[[Step | None, str], bool]


#: a prompt's state is also kept at the last multiple of this many ids in it, so requests
#: that share an opening (a system prompt, a document) and then differ reuse it
PREFIX_BLOCK = 64

#: the seeds a request may give are below this; row seeds wrap around it
SEED_LIMIT = 1 << 63
#: seconds between a waiting job's looks at its cancel event
SLOT_POLL = 0.1


@dataclass(eq=False)
class Job:
    """One generation: the whole prompt (not just its new part) and how to decode it.

    ``n`` rows are decoded at once where slots allow; ``row`` is the row the calling thread
    runs (``on_step`` is called on each row's own thread, for its steps; ``on_row_done(row)``
    when a row has ended, unless cancelled). ``around(row)`` may wrap each row's pick
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
    constraint: Callable[[int], Constraint | None] | None = None
    on_row_done: Callable[[int], None] | None = None
    _rows: threading.local = field(default_factory=threading.local, repr=False)

    @property
    def row(self) -> int:
        """The row the calling thread decodes (0 before any)."""
        return int(getattr(self._rows, "row", 0))

    @row.setter
    def row(self, value: int) -> None:
        self._rows.row = value


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
    """Runs jobs on one engine, each on its caller's thread with a session of its own."""

    def __init__(self, engine: Engine, context: int, prefix_cache: PrefixCache | None = None,
                 max_batch: int = 1):
        self.engine = engine
        self.context = context
        self.prefix = prefix_cache
        self.max_batch = max_batch
        self.lock = threading.Lock()
        #: one a sequence decoding: a job's first row waits for one, its other rows take free
        #: ones or run after (the memory plan counted ``max_batch`` sequences)
        self.slots = threading.BoundedSemaphore(max(1, max_batch))
        self.extra_rows = 0  # rows running beside their job's first
        self.jobs_done = 0
        self.cancelled = 0
        self.running = 0
        self.last: dict[str, Any] = {}
        #: the last row's generation of the job that ended last (its first logits, its steps)
        self.last_generation: Generation | None = None

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > self.context:
            raise UsageError(
                f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: "
                f"{n_prompt + max_tokens} is over the context of {self.context} tokens")

    def health(self) -> dict[str, Any]:
        """The batch as ``/health`` shows it."""
        st = self.engine.model.scheduler.stats
        out: dict[str, Any] = {"running": self.running, "max_batch": self.max_batch,
                               "extra_rows": self.extra_rows,
                               "passes": st.passes, "largest": st.most,
                               "last": st.last if self.running else 0,
                               "rows_per_pass": round(st.feeds / st.passes, 3) if st.passes else 0.0}
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.to_json()
        return out

    def run(self, job: Job) -> Outcome:
        with self.lock:
            self.running += 1
        try:
            out = self._run(job)
        finally:
            with self.lock:
                self.running -= 1
        with self.lock:
            self.jobs_done += 1
            self.cancelled += out.finish == "cancelled"
            self.last = {"finish": out.finish, "completion_tokens": len(out.ids),
                         "reused_tokens": out.reused}
        return out

    def _run(self, job: Job) -> Outcome:
        t0 = time.perf_counter()
        if not job.prompt_ids:
            raise UsageError("the prompt is empty: nothing to feed the model")
        self.check_fits(len(job.prompt_ids), job.params.max_tokens)
        while not self.slots.acquire(timeout=SLOT_POLL):  # (extra rows hold the slots)
            if job.cancel.is_set():
                return Outcome([], "cancelled", 0, 0.0)
        try:
            if job.cancel.is_set():
                return Outcome([], "cancelled", 0, 0.0)
            s = self.engine.session(incremental=True)
            s.cancel = job.cancel
            try:
                return self._rows(job, s, t0)
            except Cancelled:
                return Outcome([], "cancelled", 0, time.perf_counter() - t0)
        finally:
            self.slots.release()

    def _rows(self, job: Job, s: Session, t0: float) -> Outcome:
        prompt = job.prompt_ids
        reused = 0
        params = job.params
        head, last = prompt[:-1], prompt[-1:]
        if job.n == 1 and job.on_prompt_rows is None:
            feed, reused = self._start(s, prompt, params.spec == "off")
            rows = [self._row(job, s, 0, feed, params)]
        else:
            if job.n > 1 and not params.greedy and params.seed is None:  # one seed for all rows
                params = params.model_copy(update={"seed": time.time_ns() % SEED_LIMIT})
            if job.on_prompt_rows is None and self.prefix is not None:
                # a kept prefix of the head, the whole head included (its last id follows)
                reused, snap = self.prefix.lookup(head, leave=0)
                if snap is not None:
                    s.resume(head[:reused], snap)
            s.prefill(head[reused:], job.on_prompt_rows)
            if self.prefix is not None and job.on_prompt_rows is None and s.state is not None:
                self.prefix.store(head, s.state)
            snap = snapshot(s.state) if s.state is not None and s.state.pos else None
            rows = self._all_rows(job, s, head, last, params, snap)
        if self.prefix is not None and s.state is not None:  # the prompt and its reply so far
            self.prefix.store(s.ids[: s.state.pos], s.state)  # (a job cancelled between tokens too)
        self.last_generation = s.last
        finish = ("cancelled" if any(r.finish == "cancelled" for r in rows)
                  else "length" if any(r.finish == "length" for r in rows) else "stop")
        return Outcome([t for r in rows for t in r.ids], finish, reused,
                       time.perf_counter() - t0, rows[0].seed, rows)

    def _start(self, s: Session, prompt: list[int], plain: bool) -> tuple[list[int], int]:
        """Start ``s`` from the longest kept state of ``prompt``: what is left to feed, and how
        many ids the kept state held;
        with the prefix cache on, the prompt's state is kept after its first pass (with its
        last row's logits), and at its last :data:`PREFIX_BLOCK` boundary when it crosses one
        (a pass of its own). ``plain`` (no drafts): the same prompt kept with its logits
        starts from them, fed nothing."""
        if self.prefix is None:
            return prompt, 0
        if plain:
            exact = self.prefix.exact(prompt)
            if exact is not None:
                s.resume(prompt, exact[0])
                s.primed = exact[1]
                return [], len(prompt)
        reused, snap = self.prefix.lookup(prompt)
        if snap is not None:
            s.resume(prompt[:reused], snap)
        block = (len(prompt) - 1) // PREFIX_BLOCK * PREFIX_BLOCK
        if block > s.positions:  # a shared opening (a system prompt, a document)
            s.prefill(prompt[s.positions : block])
            assert s.state is not None
            self.prefix.store(prompt[:block], s.state)
        prefix, state_of = self.prefix, s

        def keep(logits: np.ndarray) -> None:
            assert state_of.state is not None
            prefix.store(prompt, state_of.state, logits[-1] if logits.ndim == 2 else logits)
            state_of.after_prefill = None

        s.after_prefill = keep
        return prompt[s.positions :], reused

    def _all_rows(self, job: Job, s: Session, head: list[int], last: list[int],
                  params: GenerationParams, snap: StateSnapshot | None) -> list[Row]:
        """Every row of a job of ``n``, ``s`` holding the prompt's ``head`` (its state
        ``snap``): rows 1.. on threads of their own while slots are free, row 0 and the rest
        on this thread, one after the other; rows are listed up to the first cancelled."""
        n = job.n
        got: list[Row | None] = [None] * n
        errors: list[BaseException] = []
        beside = [i for i in range(1, n) if snap is not None and self.slots.acquire(blocking=False)]

        def side(i: int) -> None:
            try:
                si = self.engine.session(incremental=True)
                si.cancel = job.cancel
                assert snap is not None
                si.resume(head, snap)
                got[i] = self._row(job, si, i, last, row_params(params, i))
            except Cancelled:
                got[i] = Row([], "cancelled")
            except BaseException as e:  # handed to the job's thread
                errors.append(e)
                job.cancel.set()  # the job fails: its other rows stop at their next step
            finally:
                self.slots.release()
                with self.lock:
                    self.extra_rows -= 1

        with self.lock:
            self.extra_rows += len(beside)
        threads = [threading.Thread(target=side, args=(i,), name=f"k3-row-{i}", daemon=True)
                   for i in beside]
        for t in threads:
            t.start()
        try:
            for i in [0] + [i for i in range(1, n) if i not in beside]:
                if i:
                    if snap is None:
                        s.reset()
                    else:
                        assert s.state is not None
                        restore(s.state, snap)
                        s.ids = list(head)
                row = got[i] = self._row(job, s, i, last, row_params(params, i))
                if row.finish == "cancelled":
                    break
        except BaseException:
            job.cancel.set()  # the rows beside stop at their next step
            raise
        finally:
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        rows: list[Row] = []
        for r in got:
            if r is None:
                break
            rows.append(r)
            if r.finish == "cancelled":
                break
        return rows

    def _row(self, job: Job, s: Session, row: int, feed: list[int],
             params: GenerationParams) -> Row:
        """Decode one row after ``feed`` (the session holds the rest of the prompt)."""
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
        finally:
            steps.close()
        gen = s.last
        if gen is not None and gen.stop_reason in ("stop_id", "eos", "stop"):
            finish = "stop"
        seed = gen.sampler.seed if gen is not None and gen.sampler is not None else None
        if finish != "cancelled" and job.on_row_done is not None:
            job.on_row_done(row)
        return Row(out, finish, seed)
