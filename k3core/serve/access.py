"""One log line per request, and the request counter of ``/metrics``.

:class:`RequestLog` is the app's outermost middleware: it sees every request (a CORS
preflight, a 404, a 401 included), notes its status as the response starts and, when the
response has ended, counts it (``k3_requests_total{route,method,status}``, the route as its
template, ``/v1/models/{model}``, so the labels stay few) and logs it on stderr:

    k3 serve: INFO: POST /v1/chat/completions 200 stop prompt 12 (4 reused) + 30 tokens 0.412 s

A request that ran a generation names how it finished (``stop``, ``length``,
``cancelled``, ``failed``) and its tokens; its line waits for the generation to end (a
client that leaves a stream ends the response first; the generation stops a token later),
so a cancelled one says so. The seconds are the response's, from the request's arrival to
its last byte.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from k3core.serve.metrics import Metrics
from k3core.serve.service import Prepared
from k3core.serve.worker import Outcome

log = logging.getLogger("k3.serve.requests")
SCOPE_KEY = "k3.record"
MAX_PATH = 200  # characters of an unknown path the log line keeps


@dataclass
class Record:
    method: str
    route: str  # the template of the route matched, or "other"
    path: str  # what the log shows
    t0: float
    status: int | None = None
    seconds: float = 0.0
    prep: Prepared | None = None


def attach(request: Request, prep: Prepared, fut: Future[Outcome]) -> None:
    """``request`` runs the generation of ``prep`` (submitted as ``fut``): its log line
    will name the generation's tokens and finish, once it has ended."""
    rec = request.scope.get(SCOPE_KEY)
    if isinstance(rec, Record):
        rec.prep = prep
        request.scope[SCOPE_KEY + ".future"] = fut


class RequestLog:
    """ASGI middleware: count and log each HTTP request once its response has ended."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _route(self, scope: Scope) -> tuple[str, str]:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                path = getattr(route, "path", "other")
                return path, path
        raw = scope.get("raw_path") or scope.get("path", "").encode()
        shown = raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)
        shown = "".join(c if c.isprintable() else "?" for c in shown)
        if len(shown) > MAX_PATH:
            shown = shown[:MAX_PATH] + "..."
        return "other", shown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, path = self._route(scope)
        rec = Record(scope.get("method", "?"), route, path, time.perf_counter())
        scope[SCOPE_KEY] = rec

        async def send_noted(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noted)
        finally:
            rec.seconds = time.perf_counter() - rec.t0
            if rec.status is None:  # nothing was sent: an exception the outer layer answers
                rec.status = 500
            self.metrics.count_request(rec.route, rec.method, rec.status)
            fut = scope.get(SCOPE_KEY + ".future")
            if isinstance(fut, Future):
                fut.add_done_callback(lambda f: self._log(rec, f))  # at once if it is done
            else:
                self._log(rec, None)

    def _log(self, rec: Record, fut: Future[Outcome] | None) -> None:
        line = f"{rec.method} {rec.path} {rec.status}"
        if rec.prep is not None and fut is not None:
            line += " " + _generation(rec.prep, fut)
        log.info("%s %.3f s", line, rec.seconds)


def _generation(prep: Prepared, fut: Future[Any]) -> str:
    if fut.cancelled():
        return f"cancelled prompt {prep.prompt_tokens} + 0 tokens"
    exc = fut.exception()
    if exc is not None:
        return f"failed ({type(exc).__name__}) prompt {prep.prompt_tokens} tokens"
    out = fut.result()
    reused = f" ({out.reused} reused)" if out.reused else ""
    return f"{out.finish} prompt {prep.prompt_tokens}{reused} + {len(out.ids)} tokens"
