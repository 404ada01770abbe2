"""One engine, one resident session, one generation at a time.

The server's engine is opened once and holds one :class:`~k3core.run.session.Session`. A job
whose prompt extends the ids that session's state has consumed continues it, feeding only
the new ids; any other prompt starts the session afresh. A session split into calls gives
the same ids and logit bytes as one run over the whole prompt, so the reused path is
bit-identical to a fresh one (``tests/serve`` checks both). The session's last generated id
is *pending* (not yet fed): a prompt that continues with another id (a chat client that sends
back ``<|end_of_msg|>`` where the model wrote ``[EOS]``) still reuses everything before it.

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

from k3core.api.errors import UsageError
from k3core.model.generate import Step
from k3core.run.engine import Engine
from k3core.run.request import GenerationParams

#: called with each step (``None`` for text released at the end) and its text piece; return
#: False to end the job
OnStep = Callable[[Step | None, str], bool]


@dataclass(eq=False)
class Job:
    """One generation: the whole prompt (not just its new part) and how to decode it."""

    prompt_ids: list[int]
    params: GenerationParams
    on_step: OnStep | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    ids: list[int]
    finish: str  # "stop" (stop id, end of sequence or stop string), "length", "cancelled"
    reused: int  # prompt ids the resident state already held
    seconds: float
    seed: int | None = None


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
        reused = self.reusable(job.prompt_ids)
        if reused:
            s.ids = s.ids[:reused]  # a pending id the prompt does not continue with is dropped
        else:
            s.reset()
        out: list[int] = []
        finish = "length"
        steps = s.steps(job.prompt_ids[reused:], job.params)
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
        return Outcome(out, finish, reused, time.perf_counter() - t0, seed)
