"""The ASGI application: OpenAI-compatible routes on Starlette, requests batched.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST
/v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers with server-sent
events: one ``data: {chunk}`` per piece of text, a last chunk with the finish reason, a usage
chunk when ``stream_options.include_usage``, then ``data: [DONE]``); ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``, the Anthropic Messages API (``k3core.serve.anthropic``);
``POST /tokenize`` and ``POST /detokenize`` (``k3core.serve.tokenize_routes``), ``GET /metrics``
(``k3core.serve.metrics``) and the chat page at ``GET /`` (``k3core.serve.page``). Every
request is counted and logged in one line (``k3core.serve.access``); CORS is off unless
origins are given (``k3core.serve.cors``).

Generations run on the engine's threads, one a slot (``max_batch`` of them), their passes
batched by the model's scheduler; the rest wait in arrival order (a FIFO queue of at most
``max_queue`` waiting requests; past it a 429). A client that goes away (a closed stream,
or a dropped connection while it waits for a plain answer) cancels its generation between
two tokens (or two chunks of its prompt), and its slot takes the next request.

Every failure is an OpenAI-style error body: 400 for bad JSON, unknown fields, bad values
or a prompt over the context; 401 for a missing or wrong API key; 404 for an unknown model
or route; 405, 408 (a request body that stopped arriving), 413, 429; a 500 only for a failure
inside the engine, with its one-line message and never a traceback.

The connections themselves (the cap, the header and idle timeouts) are
``k3core.serve.connections``'; ``/health`` shows their counts.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, cast

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from k3core.api.errors import K3Error, UsageError
from k3core.api.safejson import JSONRejected, parse_json
from k3core.serve.access import RequestLog, attach
from k3core.serve.anthropic import messages_routes
from k3core.serve.connections import Connections
from k3core.serve.cors import cors_middleware
from k3core.serve.logprobs import CompletionLogprobs, TokenLogprob, chat_logprobs
from k3core.serve.metrics import Metrics, metrics_routes
from k3core.serve.page import page_routes
from k3core.serve.protocol import (
    APIError,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    usage,
    validation_error,
)
from k3core.serve.service import Prepared, Service, TextSink, thinking_note
from k3core.serve.tokenize_routes import tokenize_routes
from k3core.serve.waiting import await_whole
from k3core.serve.worker import Outcome

STOPPING = APIError(503, "the server is stopping; this generation was cancelled",
                    type_="server_error", code="server_stopping")
MAX_BODY = 16 << 20
DRAIN_LIMIT = 64 << 20  # past this a too-large body is cut off without reading it
log = logging.getLogger("k3.serve")


def _error(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    if exc.status == 408:  # the rest of that body is not wanted
        headers = {"Connection": "close"}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Server:
    """The app's state: the service, the engine thread, the queue bound and the API key."""

    def __init__(self, service: Service, api_key: str | None = None, max_queue: int = 64,
                 connections: Connections | None = None):
        self.service = service
        self.api_key = api_key
        self.max_queue = max_queue
        self.connections = connections
        #: the longest wait for more of a request's body (the header timeout)
        self.body_timeout = connections.limits.timeout_header if connections is not None else None
        self.waiting = 0
        self._count = threading.Lock()
        # one thread a slot: the jobs' passes are batched by the model's scheduler
        self.executor = ThreadPoolExecutor(max_workers=max(1, service.worker.max_batch),
                                           thread_name_prefix="k3-engine")
        self.metrics = Metrics(service, lambda: self.waiting)

    # ---- plumbing ---------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                           type_="authentication_error", code="invalid_api_key")

    async def body(self, request: Request) -> dict[str, Any]:
        too_big = APIError(413, f"the request body is over {MAX_BODY >> 20} MiB", code="body_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > DRAIN_LIMIT:
            raise too_big
        data = bytearray()
        seen = 0
        chunks = request.stream().__aiter__()
        while True:  # read to the end, so the client hears the answer
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), self.body_timeout)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APIError(408, f"the request body stopped arriving for {self.body_timeout:g} s",
                               code="body_timeout") from None
            seen += len(chunk)
            if seen > DRAIN_LIMIT:
                raise too_big
            if seen <= MAX_BODY:
                data += chunk
        if seen > MAX_BODY:
            raise too_big
        try:
            doc = parse_json(bytes(data))
        except JSONRejected as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(doc, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return doc

    def submit(self, prep: Prepared) -> Future[Outcome]:
        if self.waiting >= self.max_queue:
            raise APIError(429, f"the server has {self.waiting} requests waiting (the limit is "
                                f"{self.max_queue}); try again shortly", type_="rate_limit_error",
                           code="queue_full")
        self.service.admit(prep.job)
        with self._count:
            self.waiting += 1
        self.metrics.submitted(prep.job)
        fut = self.executor.submit(self.metrics.run, prep)  # the service's run, measured

        def done(_: Future[Outcome]) -> None:
            self.service.release(prep.job)
            with self._count:
                self.waiting -= 1

        fut.add_done_callback(done)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # always retrieved
        return fut

    def figures(self, prep: Prepared) -> dict[str, Any] | None:
        """The reply's own figures (``k3.figures``), once its generation has run."""
        return self.metrics.figures(prep.job)

    # ---- routes ---------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        s = self.service
        w = s.worker
        out = {"status": "ok", "model": s.model_name, "context": w.context,
               "waiting": self.waiting, "requests_done": w.jobs_done,
               "cancelled": w.cancelled, "batch": w.health(), "last": w.last}
        if self.connections is not None:
            out["connections"] = self.connections.stats()
        return JSONResponse(out)

    async def models(self, request: Request) -> Response:
        self.check_key(request)
        card = ModelCard(id=self.service.model_name, created=self.service.created)
        return JSONResponse(ModelList(data=[card]).model_dump())

    async def model(self, request: Request) -> Response:
        self.check_key(request)
        self.service.check_model(request.path_params["model"])
        return JSONResponse(ModelCard(id=self.service.model_name, created=self.service.created).model_dump())

    async def completions(self, request: Request) -> Response:
        self.check_key(request)
        doc = await self.body(request)
        try:
            req = CompletionRequest.model_validate(doc)
        except ValidationError as exc:
            raise validation_error(exc) from None
        prep = await self._prepare(lambda: self.service.completion_job(req))
        return await self._answer(request, prep, req.stream, req.include_usage)

    async def chat(self, request: Request) -> Response:
        self.check_key(request)
        doc = await self.body(request)
        try:
            req = ChatCompletionRequest.model_validate(doc)
        except ValidationError as exc:
            raise validation_error(exc) from None
        prep = await self._prepare(lambda: self.service.chat_job(req))
        return await self._answer(request, prep, req.stream, req.include_usage)

    @staticmethod
    async def _prepare(make: Any) -> Prepared:
        """Tokenize and check, off the event loop (a long prompt takes a while to encode)."""
        try:
            return cast(Prepared, await asyncio.to_thread(make))
        except UsageError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None

    # ---- answers ---------------------------------------------------------------------------
    def _final(self, prep: Prepared, out: Outcome) -> dict[str, Any]:
        u = usage(prep.prompt_tokens, len(out.ids), out.reused)
        ext = {**self.service.extension(prep, out), "figures": self.metrics.figures(prep.job)}
        name = self.service.model_name
        tok = self.service.tok
        if prep.kind == "completion":
            choices = []
            for i, (sink, row) in enumerate(zip(prep.sinks, out.rows, strict=False)):
                lp = None
                if sink.recorder is not None:
                    shaper = CompletionLogprobs(tok)
                    lp = shaper.shape(*self._completion_records(prep, sink, row.ids, echo=True))
                choices.append(CompletionChoice(index=i, text=(prep.echo or "") + sink.content,
                                                finish_reason=_finish(row.finish), logprobs=lp))
            return Completion(id=prep.id, created=prep.created, model=name, choices=choices, usage=u,
                              k3=ext).model_dump()
        chats = []
        for i, (sink, row) in enumerate(zip(prep.sinks, out.rows, strict=False)):
            calls = sink.tool_calls()
            msg = ChatMessageOut(content=sink.content if sink.content or not calls else None,
                                 reasoning_content=sink.reasoning or None, tool_calls=calls,
                                 k3_note=thinking_note(sink, row),
                                 k3_warning=" ".join(sink.warnings) or None)
            lp = (chat_logprobs(tok, sink.recorder.records[: len(row.ids)])
                  if sink.recorder is not None else None)
            chats.append(ChatChoice(index=i, message=msg, finish_reason=_chat_finish(sink, row.finish),
                                    logprobs=lp))
        body = ChatCompletion(id=prep.id, created=prep.created, model=name, choices=chats, usage=u,
                              k3=ext).model_dump()
        for c in body["choices"]:  # k3_note, k3_warning and tool_calls only where there are some
            for key in ("k3_note", "k3_warning", "tool_calls"):
                if c["message"][key] is None:
                    del c["message"][key]
        return body

    @staticmethod
    def _completion_records(prep: Prepared, sink: TextSink, ids: list[int], echo: bool
                            ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The ids and records a completion's logprobs list: the prompt's first when echoed
        (``echo``) with its logprobs, then the row's own."""
        assert sink.recorder is not None
        recs: list[TokenLogprob | None] = list(sink.recorder.records[: len(ids)])
        if echo and prep.prompt_logprobs is not None:
            return list(prep.job.prompt_ids) + ids, list(prep.prompt_logprobs.records) + recs
        return ids, recs

    async def _answer(self, request: Request, prep: Prepared, stream: bool, include_usage: bool) -> Response:
        if stream:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Piece | None] = asyncio.Queue()
            for row, sink in enumerate(prep.sinks):
                sink.on_piece = _poster(loop, queue, row, sink)
            sfut = self.submit(prep)  # a full queue is a 429 before any event
            attach(request, prep, sfut)  # the request's log line names the generation
            stream_fut = asyncio.wrap_future(sfut)
            stream_fut.add_done_callback(lambda _: queue.put_nowait(None))
            return StreamingResponse(self._events(prep, stream_fut, queue, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        afut = await await_whole(request, prep, self.submit(prep))
        if afut is None:  # the client went away: its generation is cancelled
            return Response(status_code=499)
        out = self.outcome(afut)
        if out.finish == "cancelled":  # not by this client (it is still here): the server stops
            raise STOPPING
        return JSONResponse(self._final(prep, out))

    @staticmethod
    def outcome(afut: asyncio.Future[Outcome]) -> Outcome:
        """The generation's outcome, or its failure as an :class:`APIError`."""
        try:
            return afut.result()
        except UsageError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        except K3Error as exc:
            raise APIError(500, f"the engine failed: {exc}", type_="server_error", code="engine_error") from None
        except Exception as exc:
            log.error("k3 serve: %s: %s", type(exc).__name__, exc)
            raise APIError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                           code="internal_error") from None

    def _chunk(self, prep: Prepared, row: int, piece: dict[str, Any] | None, finish: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        base = {"id": prep.id, "created": prep.created, "model": self.service.model_name}
        if prep.kind == "completion":
            text = (piece or {}).get("content", "")
            return {**base, "object": "text_completion",
                    "choices": [{"index": row, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
        delta: dict[str, Any] = {}
        if piece is not None:
            if "reasoning" in piece:
                delta["reasoning_content"] = piece["reasoning"]
            if "content" in piece:
                delta["content"] = piece["content"]
            if "tool_calls" in piece:
                delta["tool_calls"] = piece["tool_calls"]
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": row, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    async def _events(self, prep: Prepared, afut: asyncio.Future[Outcome],
                      queue: asyncio.Queue[Piece | None], include_usage: bool) -> AsyncIterator[bytes]:
        tok = self.service.tok
        sent = [0] * len(prep.sinks)  # records sent, per row
        shapers = [CompletionLogprobs(tok) for _ in prep.sinks]

        def logprobs(row: int, upto: int | None, echo: bool = False) -> dict[str, Any] | None:
            sink = prep.sinks[row]
            if sink.recorder is None:
                return None
            ids = [r.id for r in sink.recorder.records[sent[row]:upto]]
            sent[row] += len(ids)
            if prep.kind == "chat":
                return chat_logprobs(tok, sink.recorder.records[sent[row] - len(ids):sent[row]])
            recs: list[TokenLogprob | None] = list(sink.recorder.records[sent[row] - len(ids):sent[row]])
            if echo and prep.prompt_logprobs is not None:
                return shapers[row].shape(list(prep.job.prompt_ids) + ids,
                                          list(prep.prompt_logprobs.records) + recs)
            return shapers[row].shape(ids, recs)

        echoed = [prep.echo is None] * len(prep.sinks)

        def echo(row: int) -> bytes:
            """A completion's echo, before the row's first piece (its prompt's logprobs are
            all known by then: the prompt is fed before the first token)."""
            if echoed[row]:
                return b""
            echoed[row] = True
            return _sse(self._chunk(prep, row, {"content": prep.echo or ""}, None,
                                    logprobs(row, 0, echo=True)))

        def piece_event(item: Piece) -> bytes:
            row, piece, seen = item
            return echo(row) + _sse(self._chunk(prep, row, piece, None, logprobs(row, seen)))

        try:
            if prep.kind == "chat":
                for row in range(len(prep.sinks)):
                    first = self._chunk(prep, row, None, None)
                    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield _sse(first)
            while True:
                item = await queue.get()
                if item is None:
                    break
                yield piece_event(item)
            while not queue.empty():  # pieces posted after the job's end marker
                item = queue.get_nowait()
                if item is not None:
                    yield piece_event(item)
            try:
                out = self.outcome(afut)
            except APIError as exc:
                yield _sse(exc.body())
                yield b"data: [DONE]\n\n"
                return
            if out.finish == "cancelled":
                yield _sse(STOPPING.body())
                yield b"data: [DONE]\n\n"
                return
            for row, r in enumerate(out.rows):
                if not echoed[row]:
                    yield echo(row)
                sink = prep.sinks[row]
                finish = _chat_finish(sink, r.finish) if prep.kind == "chat" else _finish(r.finish)
                last = self._chunk(prep, row, None, finish, logprobs(row, len(r.ids)))
                note = thinking_note(sink, r) if prep.kind == "chat" else None
                if note is not None:
                    last["choices"][0]["delta"]["k3_note"] = note
                if prep.kind == "chat" and sink.warnings:
                    last["choices"][0]["delta"]["k3_warning"] = " ".join(sink.warnings)
                yield _sse(last)
            if include_usage:
                final = self._final(prep, out)
                tail = {"id": prep.id, "created": prep.created, "model": self.service.model_name,
                        "object": "text_completion" if prep.kind == "completion" else "chat.completion.chunk",
                        "choices": [], "usage": final["usage"], "k3": final["k3"]}
                yield _sse(tail)
            yield b"data: [DONE]\n\n"
        finally:
            prep.job.cancel.set()  # the client went away (or we are done: then it is a no-op)


#: a piece of a stream: the row, its text, the steps its sink had seen
Piece = tuple[int, dict[str, Any], int]


def _poster(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Piece | None], row: int,
            sink: TextSink) -> Callable[[dict[str, Any]], None]:
    """A row's ``on_piece``: from the engine thread to the event loop's queue."""

    def post(piece: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (row, piece, sink.seen))

    return post


def _finish(finish: str) -> Literal["stop", "length"]:
    return "stop" if finish == "stop" else "length"


def _chat_finish(sink: TextSink, finish: str) -> Literal["stop", "length", "tool_calls"]:
    """A chat row's finish reason: ``tool_calls`` for a reply that ended after calling tools."""
    return "tool_calls" if finish == "stop" and sink.calls else _finish(finish)


def create_app(service: Service, api_key: str | None = None, max_queue: int = 64,
               connections: Connections | None = None, cors_origins: Sequence[str] = ()) -> Starlette:
    """The ASGI app over an opened service (``connections``: the server's, for ``/health``
    and the body timeout; ``cors_origins``: the origins whose pages may call it)."""
    srv = Server(service, api_key, max_queue, connections)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _error(exc)

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
               else f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405
               else str(exc.detail))
        return _error(APIError(exc.status_code, msg, code=code))

    async def on_other(request: Request, exc: Exception) -> Response:
        log.error("k3 serve: %s: %s", type(exc).__name__, exc)
        return _error(APIError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                               code="internal_error"))

    routes = [
        Route("/health", srv.health, methods=["GET"]),
        Route("/v1/models", srv.models, methods=["GET"]),
        Route("/v1/models/{model:path}", srv.model, methods=["GET"]),
        Route("/v1/completions", srv.completions, methods=["POST"]),
        Route("/v1/chat/completions", srv.chat, methods=["POST"]),
        *messages_routes(srv),
        *tokenize_routes(service, srv.check_key, srv.body),
        *metrics_routes(srv.metrics, srv.check_key),
        *page_routes(),
    ]
    middleware = [Middleware(RequestLog, metrics=srv.metrics, routes=routes), *cors_middleware(cors_origins)]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={APIError: on_api_error, HTTPException: on_http, Exception: on_other})
    app.state.server = srv
    return app
