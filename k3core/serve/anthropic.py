"""``POST /v1/messages``: the Anthropic Messages API on the same engine as the OpenAI routes.

A request is checked strictly (unknown fields, wrong JSON types and bad values are a 400
naming the field, as on the OpenAI routes), then turned into the OpenAI-shaped chat request
the service already runs (:func:`to_chat`): the system prompt (a string, or text blocks
joined by a blank line) first, each message's text blocks joined by a blank line, an
assistant's ``thinking`` blocks as its ``reasoning_content``; ``max_tokens`` (required),
``stop_sequences`` (the chat's ``stop``), ``temperature``, ``top_p``, ``top_k`` and k3's
``seed``; ``thinking`` ``{"type": "disabled"}`` is ``reasoning_effort`` ``none``,
``enabled`` (its ``budget_tokens`` is not enforced) or ``adaptive`` the server's effort,
absent the server's default. So the same conversation gives the same ids on either API.

Tools go the same way: ``tools`` (``name``, ``description``, ``input_schema``) become
OpenAI function tools, ``tool_choice`` ``auto``/``any``/``tool``/``none`` the chat's
``auto``/``required``/a named function/``none`` (``disable_parallel_tool_use``: no parallel
calls), an assistant's ``tool_use`` blocks its ``tool_calls``, a user's ``tool_result``
blocks ``role: "tool"`` messages before the rest of its text (each must answer a
``tool_use`` of the assistant message before it). The model's calls come back as
``tool_use`` blocks (``stop_reason`` ``tool_use``), streamed as ``input_json_delta``.

The answer is a ``message``: a ``thinking`` block (the thinking channel, when there is
one; ``signature`` empty), a ``text`` block, ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence`` with the string in ``stop_sequence``), ``usage`` (``input_tokens`` the
prompt tokens fed, ``cache_read_input_tokens`` those a kept prefix state already held,
``output_tokens``) and k3's own ``k3`` field. ``stream: true`` sends Anthropic's events:
``message_start``, ``ping``, then per block ``content_block_start``,
``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``),
``content_block_stop``, then
``message_delta`` (stop reason and usage) and ``message_stop``; a failure after the stream
began is an ``error`` event.

Refusals are Anthropic's error bodies, ``{"type": "error", "error": {"type", "message"}}``,
with the status of the OpenAI routes. The key is taken from ``x-api-key`` or ``Authorization:
Bearer``; ``anthropic-version`` and ``anthropic-beta`` are accepted and not read.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import Future
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from k3core.api.errors import UsageError
from k3core.serve.access import attach
from k3core.serve.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    TOOL_NAME,
    APIError,
    ChatCompletionRequest,
    refuse_non_text,
    validation_error,
)
from k3core.serve.service import Prepared, Service, TextSink, thinking_note
from k3core.serve.waiting import await_whole
from k3core.serve.worker import Outcome

#: Anthropic's error type for each status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
#: the thinking channel, and how to turn it off, in this API's words (``thinking_note``)
NOTE_WORDS = ("the thinking block", 'thinking {"type": "disabled"}')
#: block types k3 cannot read, and what they are
_NOT_TEXT = {"image": "image", "document": "document (PDF or file)", "search_result": "search result",
             "server_tool_use": "server tool", "web_search_tool_result": "server tool result",
             "container_upload": "file"}


class Server(Protocol):
    """What the route needs of the app's server (``k3core.serve.app.Server``)."""

    service: Service
    api_key: str | None

    def check_key(self, request: Request) -> None: ...

    def body(self, request: Request) -> Awaitable[dict[str, Any]]: ...

    def submit(self, prep: Prepared) -> Future[Outcome]: ...

    def outcome(self, afut: asyncio.Future[Outcome]) -> Outcome: ...

    def figures(self, prep: Prepared) -> dict[str, Any] | None: ...


# ---- the request ----------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    """Prompt caching hints: accepted and not read (the prefix cache reuses any kept prefix)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


def _readable(v: Any) -> Any:
    """Blocks k3 cannot read (an image, a document, redacted thinking) refused in words."""
    for i, kind in enumerate(refuse_non_text(v, _NOT_TEXT, "block")):
        if kind == "redacted_thinking":
            raise ValueError(f"block {i} is redacted thinking, which only its own model can "
                             "read; leave it out")
    return v


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextBlock] | None, BeforeValidator(_readable)] = None
    is_error: bool | None = None  # accepted: the Kimi K3 format has no mark for it
    cache_control: CacheControl | None = None


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageIn(_Strict):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[Block], BeforeValidator(_readable)]


def _custom_tools(v: Any) -> Any:
    """Anthropic's server tools (web search, code execution, ...) refused in words."""
    if isinstance(v, list):
        for i, tool in enumerate(v):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"k3 runs no server tools: tool {i} is of type {kind!r}; declare "
                                 "your own tools (name, description, input_schema) and run them")
    return v


class ToolIn(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.fullmatch(v):
            raise ValueError(f"a tool's name is 1..64 letters, digits, '_' or '-', got {v[:70]!r}")
        return v


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, validate_default=True)
    disable_parallel_tool_use: bool | None = None

    @field_validator("name")
    @classmethod
    def _named(cls, v: str | None, info: ValidationInfo) -> str | None:
        if (v is not None) != (info.data.get("type") == "tool"):
            raise ValueError("a name goes with type 'tool', and only with it")
        return v


Tools = Annotated[list[ToolIn] | None, BeforeValidator(_custom_tools), Field(max_length=MAX_TOOLS)]


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)
    display: str | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: Annotated[str | list[TextBlock] | None, BeforeValidator(_readable)] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    thinking: Thinking | None = None
    tools: Tools = None
    tool_choice: ToolChoice | None = None
    # accepted and not read: they do not change the answer
    metadata: dict[str, str | None] | None = None
    service_tier: str | None = None
    cache_control: CacheControl | None = None
    inference_geo: str | None = None
    # k3's own
    seed: int | None = Field(None, ge=0, lt=1 << 63)

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(v)}")
            if any(not s or len(s) > MAX_STOP_CHARS for s in v):
                raise ValueError(f"each stop sequence must be 1..{MAX_STOP_CHARS} characters")
        return v or None


class CountRequest(_Strict):
    """``/v1/messages/count_tokens``: a request's prompt, without the generation's fields."""

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: Annotated[str | list[TextBlock] | None, BeforeValidator(_readable)] = None
    thinking: Thinking | None = None
    tools: Tools = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None


def _text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n\n".join(b.text for b in content if isinstance(b, TextBlock))


def _refuse(where: str, message: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where, code="invalid_value")


def _message(i: int, m: MessageIn, calls: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages; ``calls``: the ``tool_use`` ids of the
    assistant message before it (a ``tool_result`` answers one of them)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if m.role == "user" and isinstance(b, (ThinkingBlock, ToolUseBlock)):
            raise _refuse(where, f"a {b.type} block belongs in an assistant message")
        if m.role == "assistant" and isinstance(b, ToolResultBlock):
            raise _refuse(where, "a tool_result block belongs in a user message (after the "
                                 "assistant message whose tool_use it answers)")
        if isinstance(b, ToolResultBlock):
            if b.tool_use_id not in calls:
                raise _refuse(where, f"tool_result for {b.tool_use_id!r}, which matches no tool_use "
                                     "of the assistant message before it")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
    text = _text(m.content)
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        thought = "\n\n".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
        if thought:
            msg["reasoning_content"] = thought
        uses = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                for b in m.content if isinstance(b, ToolUseBlock)]
        if uses:
            msg["tool_calls"] = uses
        return [msg]
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def to_chat(req: MessagesRequest | CountRequest, service: Service) -> dict[str, Any]:
    """The OpenAI-shaped chat request of an Anthropic one (module docstring)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise _refuse(f"messages.{last}", "the last message is the assistant's: k3 does not continue "
                                          "a reply given in advance (prefill); end with a user message")
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        messages += _message(i, m, calls)
        if m.role == "assistant":
            calls = ({b.id for b in m.content if isinstance(b, ToolUseBlock)}
                     if not isinstance(m.content, str) else set())
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}}
            for t in req.tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        chat["tool_choice"] = ({"type": "function", "function": {"name": c.name}} if c.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[c.type])
        if c.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if req.thinking is not None:
        chat["reasoning_effort"] = "none" if req.thinking.type == "disabled" else service.effort
    if isinstance(req, MessagesRequest):
        chat["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(req, name) is not None:
                chat[name] = getattr(req, name)
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
    else:
        chat["max_tokens"] = 0
    return chat


def _chat_request(chat: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(exc) from None


# ---- the answer -----------------------------------------------------------------------------
def error_body(exc: APIError) -> dict[str, Any]:
    """An :class:`APIError` in Anthropic's shape."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    headers = {"x-should-retry": "false"} if exc.status < 500 else None
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)


def stop_reason(sink: TextSink, finish: str) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a row."""
    if finish == "length":
        return "max_tokens", None
    if sink.stop_string is not None:
        return "stop_sequence", sink.stop_string
    if sink.calls:
        return "tool_use", None
    return "end_turn", None


def usage_of(prep: Prepared, out: Outcome) -> dict[str, int]:
    return {"input_tokens": prep.prompt_tokens - out.reused, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": out.reused, "output_tokens": len(out.ids)}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _event(kind: str, data: dict[str, Any]) -> bytes:
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n".encode()


class Messages:
    """The ``/v1/messages`` routes over the app's server."""

    def __init__(self, srv: Server):
        self.srv = srv

    @property
    def service(self) -> Service:
        return self.srv.service

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    def check_key(self, request: Request) -> None:
        key = self.srv.api_key
        if key is None:
            return
        given = request.headers.get("x-api-key")
        if given is not None and hmac.compare_digest(given.strip().encode(), key.encode()):
            return
        try:
            self.srv.check_key(request)
        except APIError:
            raise APIError(401, "missing or wrong API key (send x-api-key: KEY, or Authorization: "
                                "Bearer KEY)", type_="authentication_error",
                           code="invalid_api_key") from None

    async def _prepare(self, request: Request, model: type[MessagesRequest] | type[CountRequest]
                       ) -> tuple[MessagesRequest | CountRequest, Prepared]:
        self.check_key(request)
        doc = await self.srv.body(request)
        try:
            req = model.model_validate(doc)
        except ValidationError as exc:
            raise validation_error(exc) from None
        chat = _chat_request(to_chat(req, self.service))
        try:
            prep = await asyncio.to_thread(self.service.chat_job, chat)
        except UsageError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        prep.id = message_id()
        return req, prep

    async def count_tokens(self, request: Request) -> Response:
        try:
            _, prep = await self._prepare(request, CountRequest)
        except APIError as exc:
            return error_response(exc)
        return JSONResponse({"input_tokens": prep.prompt_tokens})

    async def messages(self, request: Request) -> Response:
        try:
            req, prep = await self._prepare(request, MessagesRequest)
            assert isinstance(req, MessagesRequest)
            if req.stream:
                return self._stream(request, prep)
            return await self._whole(request, prep)
        except APIError as exc:
            return error_response(exc)

    # ---- a whole message ----------------------------------------------------------------------
    async def _whole(self, request: Request, prep: Prepared) -> Response:
        afut = await await_whole(request, prep, self.srv.submit(prep))
        if afut is None:  # the client went away: its generation is cancelled
            return Response(status_code=499)
        out = self.srv.outcome(afut)
        if out.finish == "cancelled":
            raise APIError(503, "the server is stopping; this generation was cancelled",
                           type_="server_error", code="server_stopping")
        return JSONResponse(self.body(prep, out))

    def body(self, prep: Prepared, out: Outcome) -> dict[str, Any]:
        sink, row = prep.sink, out.rows[0]
        content: list[dict[str, Any]] = []
        if sink.reasoning:
            content.append({"type": "thinking", "thinking": sink.reasoning, "signature": ""})
        if sink.content or not sink.calls:
            content.append({"type": "text", "text": sink.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
                    for c in sink.calls]
        reason, seq = stop_reason(sink, row.finish)
        msg: dict[str, Any] = {
            "id": prep.id, "type": "message", "role": "assistant", "model": self.service.model_name,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage_of(prep, out),
            "k3": {**self.service.extension(prep, out), "figures": self.srv.figures(prep)}}
        note = thinking_note(sink, row, *NOTE_WORDS)
        if note is not None:
            msg["k3_note"] = note
        if sink.warnings:
            msg["k3_warning"] = " ".join(sink.warnings)
        return msg

    # ---- a stream of events -------------------------------------------------------------------
    def _stream(self, request: Request, prep: Prepared) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def post(piece: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, piece)

        prep.sink.on_piece = post
        fut = self.srv.submit(prep)  # a full queue is a 429 before any event
        attach(request, prep, fut)
        afut = asyncio.wrap_future(fut)
        afut.add_done_callback(lambda _: queue.put_nowait(None))
        return StreamingResponse(self._events(prep, afut, queue), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, prep: Prepared, afut: asyncio.Future[Outcome],
                      queue: asyncio.Queue[dict[str, Any] | None]) -> AsyncIterator[bytes]:
        blocks = _Blocks()
        start: dict[str, Any] = {"id": prep.id, "type": "message", "role": "assistant",
                 "model": self.service.model_name, "content": [], "stop_reason": None,
                 "stop_sequence": None,
                 "usage": {"input_tokens": prep.prompt_tokens, "output_tokens": 0}}
        try:
            yield _event("message_start", {"type": "message_start", "message": start})
            yield _event("ping", {"type": "ping"})
            while True:
                piece = await queue.get()
                if piece is None:
                    break
                for out in blocks.piece(piece):
                    yield out
            while not queue.empty():  # pieces posted after the job's end marker
                piece = queue.get_nowait()
                if piece is not None:
                    for out in blocks.piece(piece):
                        yield out
            try:
                outcome = self.srv.outcome(afut)
                if outcome.finish == "cancelled":
                    raise APIError(503, "the server is stopping; this generation was cancelled",
                                   type_="server_error", code="server_stopping")
            except APIError as exc:
                yield _event("error", error_body(exc))
                return
            for out in blocks.end():
                yield out
            reason, seq = stop_reason(prep.sink, outcome.rows[0].finish)
            u = usage_of(prep, outcome)
            delta: dict[str, Any] = {"type": "message_delta",
                                     "delta": {"stop_reason": reason, "stop_sequence": seq},
                                     "usage": {"input_tokens": u["input_tokens"],
                                               "cache_read_input_tokens": u["cache_read_input_tokens"],
                                               "output_tokens": u["output_tokens"]},
                                     "k3": {**self.service.extension(prep, outcome),
                                            "figures": self.srv.figures(prep)}}
            note = thinking_note(prep.sink, outcome.rows[0], *NOTE_WORDS)
            if note is not None:
                delta["k3_note"] = note
            if prep.sink.warnings:
                delta["k3_warning"] = " ".join(prep.sink.warnings)
            yield _event("message_delta", delta)
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            prep.job.cancel.set()  # the client went away (or we are done: then a no-op)


class _Blocks:
    """The content blocks of a streamed message, opened and closed as the channels change."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.had_text = False
        self.had_calls = False

    def _start(self, kind: str, block: dict[str, Any] | None = None) -> list[bytes]:
        out = self._stop()
        self.index += 1
        self.open = kind
        if block is None:
            block = ({"type": "thinking", "thinking": "", "signature": ""}
                     if kind == "thinking" else {"type": "text", "text": ""})
        self.had_text = self.had_text or kind == "text"
        self.had_calls = self.had_calls or kind == "tool_use"
        out.append(_event("content_block_start", {"type": "content_block_start",
                                                  "index": self.index, "content_block": block}))
        return out

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def piece(self, piece: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        for d in piece.get("tool_calls", ()):  # a whole call: its head, then its arguments
            fn = d.get("function", {})
            if "id" in d:
                out += self._start("tool_use", {"type": "tool_use", "id": d["id"],
                                                "name": fn.get("name", ""), "input": {}})
            elif fn.get("arguments"):
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}}))
        for name, kind, delta in (("reasoning", "thinking", "thinking_delta"),
                                  ("content", "text", "text_delta")):
            text = piece.get(name)
            if not text:
                continue
            if self.open != kind:
                out += self._start(kind)
            field = "thinking" if kind == "thinking" else "text"
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                      "delta": {"type": delta, field: text}}))
        return out

    def end(self) -> list[bytes]:
        """Close the open block; a message with neither text nor calls gets an empty text
        block."""
        out = [] if self.had_text or self.had_calls else self._start("text")
        return out + self._stop()


def messages_routes(srv: Server) -> list[Route]:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` over ``srv``."""
    return Messages(srv).routes()

