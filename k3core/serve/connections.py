"""The server's connections: a cap below the file limit, header and idle timeouts, one
summary log line a second at most.

One client must not be able to cut the server off, so every connection is bounded:

- **A cap.** At most ``max_connections`` are open at once, a number checked at start against
  the process's file limit (``RLIMIT_NOFILE``, less the files already open, room for a burst
  of accepts and for files the engine opens later: :func:`connection_room`). A connection
  past the cap takes the place of the one that has been idle longest (between requests, or
  still sending its request's head), which is closed; only when every open connection is in
  a request is the new one refused, at once, with a 503. So a flood of idle connections
  closes its own oldest sockets, and ``/health`` (or any real request) still gets in.
- **A header timeout.** A connection must deliver its request's head (the request line and
  the headers) within ``timeout_header`` seconds of opening, or of the first byte of a later
  request; else it is closed. The app applies the same bound to each wait for request-body
  bytes (a 408).
- **An idle timeout.** Between requests a keep-alive connection may stay quiet for
  ``timeout_idle`` seconds (uvicorn's ``timeout_keep_alive``), then it is closed.
- **Quiet logs.** Connections closed to make room, refused ones and the event loop's own
  errors (an ``accept()`` that failed: ``Too many open files``) are counted, and the counts
  are logged as one line at most once a second, never with a traceback.

:class:`Connections` holds the counts (``/health`` shows them); :func:`protocol_class` is the
HTTP protocol (uvicorn's h11 protocol with the cap and the header timeout) that uvicorn runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import resource
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from k3core.api.errors import UsageError

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_TIMEOUT_HEADER = 10.0
DEFAULT_TIMEOUT_IDLE = 30.0
#: the fewest connections worth serving with
MIN_CONNECTIONS = 4
#: files kept free for the engine, the logs and the interpreter
SPARE_FILES = 32
LONGEST_TIMEOUT = 24 * 3600.0

#: how counts are worded in the summary line
_WORDS = {
    "closed_idle": "idle connections closed to make room",
    "refused": "connections refused (every open one is in a request)",
    "accept_errors": "failed accepts",
    "loop_errors": "event-loop errors",
}


@dataclass(frozen=True)
class Limits:
    max_connections: int
    timeout_header: float
    timeout_idle: float
    backlog: int


def file_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` (a large number when unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def open_files() -> int:
    """File descriptors this process holds now."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(len(os.listdir(d)) - 1, 0)  # less the one listdir held
        except OSError:
            continue
    return 64  # cannot tell: assume a few


def backlog_for(limit: int) -> int:
    """The listen backlog, which is also how many sockets one wake-up may accept."""
    return max(16, min(128, limit // 5))


def connection_room() -> tuple[int, str]:
    """How many connections may be open at once under the file limit, and how that was found.

    Each connection is one descriptor. Kept free: what is open now, two accept bursts (one
    accepted but not yet counted, one closed but not yet released) and :data:`SPARE_FILES`."""
    limit = file_limit()
    now = open_files()
    backlog = backlog_for(limit)
    room = limit - now - 2 * backlog - SPARE_FILES
    how = (f"the file limit (ulimit -n) is {limit}, {now} are open, {2 * backlog + SPARE_FILES} "
           "are kept for bursts of accepts and for files")
    return room, how


def _seconds(flag: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= LONGEST_TIMEOUT):
        raise UsageError(f"{flag} must be a number of seconds in (0, {LONGEST_TIMEOUT:.0f}], got {value}")
    return float(value)


def plan_limits(max_connections: int | None, timeout_header: float, timeout_idle: float) -> tuple[Limits, str | None]:
    """The limits for the flags (``None``: the default cap, lowered to fit the file limit);
    the second value is a note when the default had to be lowered."""
    th = _seconds("--timeout-header", timeout_header)
    ti = _seconds("--timeout-idle", timeout_idle)
    room, how = connection_room()
    note = None
    if max_connections is None:
        if room < MIN_CONNECTIONS:
            raise UsageError(f"no room for connections: {how}, which leaves {max(room, 0)}; raise "
                             "ulimit -n")
        cap = min(DEFAULT_MAX_CONNECTIONS, room)
        if cap < DEFAULT_MAX_CONNECTIONS:
            note = f"at most {cap} connections at once ({how})"
    else:
        if max_connections < 1:
            raise UsageError(f"--max-connections must be >= 1, got {max_connections}")
        if max_connections > room:
            raise UsageError(f"--max-connections {max_connections} is more than this process can hold "
                             f"open: {how}, which leaves {max(room, 0)}; ask for fewer or raise ulimit -n")
        cap = max_connections
    return Limits(cap, th, ti, backlog_for(file_limit())), note


class Connections:
    """The open connections of one server, in the order they became idle, and the counts."""

    def __init__(self, limits: Limits, log: logging.Logger | None = None, interval: float = 1.0):
        self.limits = limits
        self.log = log or logging.getLogger("k3.serve")
        self.interval = interval
        self.live: dict[Any, None] = {}  # open connections (an ordered set)
        self.idle: OrderedDict[Any, None] = OrderedDict()  # between requests, longest idle first
        self.totals: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()
        self._details: dict[str, str] = {}
        self._flush: asyncio.TimerHandle | None = None
        self._since = 0.0

    # ---- the cap ------------------------------------------------------------------------
    def admit(self, conn: Any) -> bool:
        """Count a new connection in, closing the longest-idle one to make room at the cap;
        False (refuse it) when every open connection is in a request."""
        if len(self.live) >= self.limits.max_connections:
            if not self.idle:
                self.note("refused")
                return False
            victim, _ = self.idle.popitem(last=False)
            self.drop(victim)
            victim.close_idle()
            self.note("closed_idle")
        self.live[conn] = None
        self.idle[conn] = None
        return True

    def busy(self, conn: Any) -> None:
        """A request's head arrived: not idle until its response is sent."""
        self.idle.pop(conn, None)

    def rested(self, conn: Any) -> None:
        """A response was sent: idle again, the most recent."""
        if conn in self.live:
            self.idle[conn] = None
            self.idle.move_to_end(conn)

    def drop(self, conn: Any) -> None:
        self.live.pop(conn, None)
        self.idle.pop(conn, None)

    def stats(self) -> dict[str, int]:
        return {"open": len(self.live), "idle": len(self.idle), "max": self.limits.max_connections,
                **{k: self.totals[k] for k in ("closed_idle", "refused", "timed_out", "accept_errors")}}

    # ---- counts and the summary line ----------------------------------------------------
    def note(self, kind: str, detail: str | None = None) -> None:
        """Count one event; the counts are logged within a second, as one line."""
        self.totals[kind] += 1
        if kind not in _WORDS:
            return
        if not self._pending:
            self._since = time.monotonic()
        self._pending[kind] += 1
        if detail:
            self._details[kind] = detail
        if self._flush is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._flush = loop.call_later(self.interval, self.flush)

    def flush(self) -> None:
        self._flush = None
        if not self._pending:
            return
        parts = []
        for kind, words in _WORDS.items():
            n = self._pending.get(kind, 0)
            if n:
                detail = self._details.get(kind)
                parts.append(f"{n} {words}" + (f" (last: {detail})" if detail else ""))
        self._pending.clear()
        self._details.clear()
        self.log.warning("connections in the last %.1f s: %s; at most %d open at once",
                         time.monotonic() - self._since, ", ".join(parts),
                         self.limits.max_connections, extra={"summary": True})

    def loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The event loop's exception handler: counted, summarized, never a traceback."""
        exc = context.get("exception")
        message = str(context.get("message", ""))
        if isinstance(exc, OSError) and "accept" in message:
            self.note("accept_errors", exc.strerror or str(exc))
        else:
            what = f"{type(exc).__name__}: {exc}" if exc is not None else ""
            self.note("loop_errors", " ".join(f"{message} {what}".split())[:200])


def _busy_answer(limits: Limits) -> bytes:
    body = json.dumps({"error": {
        "message": f"the server has {limits.max_connections} connections open, all in a request; "
                   "try again shortly", "type": "server_error", "param": None,
        "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n")
    return head.encode() + body


def protocol_class(conns: Connections) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol under ``conns``' cap and header timeout."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy_answer = _busy_answer(conns.limits)
    header_s = conns.limits.timeout_header

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if not conns.admit(self):
                self._refused = True
                self.transport = transport  # type: ignore[assignment]
                transport.write(busy_answer)  # type: ignore[attr-defined]
                transport.close()
                return
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            conns.drop(self)
            if not self._refused:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self._between_requests():
                self._arm()  # the first bytes of a request after a keep-alive pause
            super().data_received(data)
            self._check_started()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                conns.rested(self)
            super().on_response_complete()  # arms uvicorn's idle (keep-alive) timer
            self._check_started()  # a pipelined request may have begun

        # ---- the header deadline ----------------------------------------------------------
        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _check_started(self) -> None:
            if not self._between_requests():
                self._disarm()
                conns.busy(self)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _header_timeout(self) -> None:
            self._deadline = None
            if self._between_requests() and not self.transport.is_closing():
                conns.note("timed_out")
                self.close_idle()

        def close_idle(self) -> None:
            """Close a connection that is not in a request (its head never came, or it idles)."""
            self._disarm()
            self._unset_keepalive_if_required()
            if not self.transport.is_closing():
                self.transport.close()

    return Guarded
