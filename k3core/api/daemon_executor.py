"""A one-thread executor on a daemon thread.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so a
job stuck in the kernel (a read of a hung disk) would keep the process from exiting after
Ctrl-C. :class:`DaemonExecutor` runs its jobs in submission order on one daemon thread,
started on the first submit; ``shutdown`` stops it with a bounded join. While it waits for
the next job it holds no reference to the last one, so an owner dropped without
``shutdown`` can be collected (and a finalizer of the owner's may then stop the thread).
The trunk's chunk reads ahead (k3core/trunk/windows.py) and the MoE's read scheduling beside
the shared experts (k3core/model/local_experts.py) use it.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

#: how long ``shutdown(wait=True)`` waits for the thread (it is a daemon thread either way)
JOIN_SECONDS = 5.0


class DaemonExecutor(Executor):
    """Jobs in submission order on one daemon thread (see the module docstring)."""

    def __init__(self, name: str = "k3-daemon"):
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                      | None] = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._closed:
            raise RuntimeError(f"{self._name} is shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        fut: Future[Any] = Future()
        self._jobs.put((fut, functools.partial(fn, **kwargs) if kwargs else fn, args))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            del job  # an idle thread holds nothing of its last job (nor what the job held)
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # handed to the waiting caller
                    fut.set_exception(exc)
                    del exc
            del fut, fn, args

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._jobs.put(None)
        t = self._thread
        if wait and t is not None and t is not threading.current_thread():
            t.join(JOIN_SECONDS)
