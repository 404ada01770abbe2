"""Threads in the shipped suites: an exception in any thread fails the test, with its story.

pytest reports an exception raised in a thread the test started only as a warning, and the
test passes. The suites use :func:`run_threads` for the threads they start (every thread's
exception is collected and the test fails naming the thread and what it raised) and
:func:`thread_errors_fail` around each test for the threads a plugin starts itself (an
exception that reaches ``threading.excepthook`` fails the test at its teardown).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ThreadFailure(AssertionError):
    """One or more threads raised; the message names each and its exception."""


def _story(failures: list[tuple[str, BaseException, str]], head: str) -> str:
    first_name, first_exc, first_tb = failures[0]
    lines = [f"{head}; first, in {first_name}: {type(first_exc).__name__}: {first_exc}"]
    for name, exc, _ in failures[1:4]:
        lines.append(f"  also {name}: {type(exc).__name__}: {exc}")
    if len(failures) > 4:
        lines.append(f"  ... and {len(failures) - 4} more")
    lines.append(first_tb.rstrip())
    return "\n".join(lines)


def run_threads(target: Callable[[int, threading.Barrier], None], n: int, *, what: str,
                timeout: float = 120.0) -> None:
    """Run ``target(i, barrier)`` on ``n`` threads at once; raise :class:`ThreadFailure` if any
    raised or did not finish within ``timeout`` seconds.

    ``barrier`` is shared by the ``n`` threads (``barrier.wait()`` lines them up, so their
    work overlaps); when one thread fails the barrier is broken, so none waits forever, and
    the first exception that is not the broken barrier is the one reported.
    """
    __tracebackhide__ = True
    barrier = threading.Barrier(n)
    failures: list[tuple[str, BaseException, str]] = []
    lock = threading.Lock()

    def body(i: int) -> None:
        try:
            target(i, barrier)
        except BaseException as exc:  # every thread's story is told, none is a warning
            with lock:
                failures.append((f"thread {i}", exc, traceback.format_exc()))
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,), name=f"k3-suite-{i}", daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        barrier.abort()
        raise ThreadFailure(f"{what}: {len(stuck)} of {n} threads still running after "
                            f"{timeout:.0f} s ({', '.join(stuck[:4])}): a call that never returns")
    if failures:
        real = [f for f in failures if not isinstance(f[1], threading.BrokenBarrierError)]
        told = real or failures
        raise ThreadFailure(_story(told, f"{what}: {len(told)} of {n} threads raised"))


@contextmanager
def thread_errors_fail(what: str = "the test") -> Iterator[None]:
    """Fail (``ThreadFailure``, at exit) when any thread's exception reaches
    ``threading.excepthook`` inside the block: a thread a plugin started and did not watch."""
    caught: list[tuple[str, BaseException, str]] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        exc = args.exc_value if args.exc_value is not None else args.exc_type()
        name = args.thread.name if args.thread is not None else "an unknown thread"
        caught.append((f"thread {name!r}", exc,
                       "".join(traceback.format_exception(args.exc_type, exc, args.exc_traceback))))

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
    if caught:
        raise ThreadFailure(_story(caught, f"{what}: {len(caught)} exception(s) escaped a "
                                           "thread (raised where nothing caught them)"))
