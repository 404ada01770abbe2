"""Many generations on one engine at once: each on a thread of its own, their passes batched.

:func:`run_batch` is what ``Engine.generate_batch`` and ``k3 run --batch-file`` call. Every
prompt gets a fresh session on a worker thread; the sessions' forward passes meet in the
model's scheduler (:mod:`k3core.model.scheduler`), which runs the passes asked at once as one
batched step. At most ``max_batch`` prompts run at a time; the rest wait their turn, in order.
Each result is the bytes of the same prompt run alone (each row keeps its own seeded draw).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from k3core.api.errors import UsageError
from k3core.run.binding import Bound
from k3core.run.generation import Generation
from k3core.run.report import run_record
from k3core.run.request import GenerationParams
from k3core.run.session import Session


class SessionMaker(Protocol):
    """An open engine (:class:`k3core.run.engine.Engine`): fresh sessions on it."""

    def session(self, incremental: bool | None = None) -> Session: ...

#: how many prompts run at once unless the caller says
DEFAULT_BATCH = 8
#: the most sequences ``--max-batch`` may decode together (``k3 run --batch-file``, ``k3 serve``)
MAX_BATCH = 256


def check_max_batch(value: int | None) -> int | None:
    """``--max-batch`` as given (``None``: not given), or a ``UsageError`` outside 1..MAX_BATCH."""
    if value is not None and not 1 <= value <= MAX_BATCH:
        raise UsageError(f"--max-batch must be in 1..{MAX_BATCH}, got {value}")
    return value

#: one prompt of a batch: text or ids, and its generation parameters
BatchItem = tuple[str | Sequence[int], GenerationParams]
#: called as each prompt finishes: its index and its generation, or the error that ended it
OnResult = Callable[[int, Generation | BaseException], None]


def run_batch(engine: SessionMaker, items: Sequence[BatchItem], *, max_batch: int | None = None,
              on_result: OnResult | None = None) -> list[Generation | BaseException]:
    """Run every item; results in the items' order (a failed prompt's error in its place,
    the others unaffected). ``on_result`` hears each as it finishes."""
    n = DEFAULT_BATCH if max_batch is None else int(max_batch)
    if n < 1:
        raise UsageError(f"the batch size must be at least 1, got {max_batch}")
    results: list[Generation | BaseException | None] = [None] * len(items)
    lock = threading.Lock()
    next_item = iter(range(len(items)))
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                i = next(next_item, None)
            if i is None:
                return
            prompt, params = items[i]
            out: Generation | BaseException
            try:
                session = engine.session()
                session.cancel = stop  # Ctrl-C: its next pass does not start
                gen = session.generate(prompt, params)
                if isinstance(engine, Bound):
                    gen.report = run_record(engine, gen)
                out = gen
            except Exception as e:  # this prompt's failure; the others go on
                out = e
            results[i] = out
            if on_result is not None:
                with lock:
                    on_result(i, out)

    threads = [threading.Thread(target=work, name=f"k3-batch-{j}", daemon=True)
               for j in range(min(n, len(items)))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except BaseException:
        stop.set()  # Ctrl-C: no new prompt starts; the running ones end before their next pass
        for t in threads:  # and are gone before the caller closes the engine
            t.join(60)
        raise
    return [r if r is not None else UsageError("not run") for r in results]

