"""From an OpenAI-style request to a worker job and back: prompts, limits, text, usage.

:class:`Service` holds what the server opened once (the engine's worker, the tokenizer, the
chat format, the served model's name). :meth:`Service.completion_job` and
:meth:`Service.chat_job` check a request against the model (its name, the vocabulary, the
context) and build a :class:`Prepared`: the worker job plus a :class:`TextSink` that turns
the generated ids into text pieces as they arrive (cut before a stop string, never inside a
UTF-8 character; for chat, split into the reasoning and response channels). Streamed and
non-streamed answers are built from the same pieces, so they carry the same text.

A request of ``n`` rows has one sink per row (the job's ``row`` says which runs); the
penalties (``k3core.model.penalties``) and the logprob recorder (``k3core.serve.logprobs``)
wrap each row's pick, the recorder outside, so it reads the exact logits.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import numpy as np

from k3core.api.errors import UsageError
from k3core.constrain.grammar import GrammarConstraint, lark_grammar
from k3core.model.penalties import Penalties
from k3core.model.steps import Step
from k3core.run.request import MAX_GEN, GenerationParams, build
from k3core.run.session import PickWrap
from k3core.run.stops import TextStream
from k3core.serve.chat_format import (
    ChatFormat,
    Message,
    ReplyStream,
    ToolCall,
    XtmlFormat,
    chat_format_for,
)
from k3core.serve.logprobs import PromptRecorder, Recorder
from k3core.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from k3core.serve.reply_grammar import forced_calls, json_reply
from k3core.serve.tool_calls import (
    Parsed,
    Pending,
    ToolStream,
    bind_answers,
    choice_note,
    format_note,
    render_request,
)
from k3core.serve.worker import Job, Outcome, Row, Worker
from k3core.tokenizer.encoding import Tokenizer, TokenLimitExceeded

#: what ``/v1/completions`` generates when ``max_tokens`` is not given (OpenAI's default)
DEFAULT_COMPLETION_TOKENS = 16


@dataclass
class Prepared:
    job: Job
    sinks: list[TextSink]  # one per row
    prompt_tokens: int
    kind: str  # "completion" or "chat"
    id: str
    created: int
    #: a completion's ``echo``: the prompt's text, shown before each row's
    echo: str | None = None
    #: the prompt's logprobs (a completion's ``echo`` with ``logprobs``)
    prompt_logprobs: PromptRecorder | None = None

    @property
    def sink(self) -> TextSink:
        return self.sinks[0]


class TextSink:
    """The text of one generation as it arrives: ``{"content": ..., "reasoning": ...}`` pieces.

    A completion shows the session's own text (the run pipeline's stop strings, never half a
    UTF-8 character). A chat reply is read by its format's :class:`ReplyStream`: each
    channel's ids become text through their own :class:`TextStream`, and stop strings apply
    to the response channel only (``on_step`` returns False once one appears). Its tools
    channel is read into calls (``tools``: a reader that knows the declared names); a call
    that does not read, or a tools channel nobody asked for, becomes content text and a
    warning.
    """

    def __init__(self, tok: Tokenizer, stops: list[str], fmt: ChatFormat | None,
                 recorder: Recorder | None = None, tools: ToolStream | None = None):
        self.reply: ReplyStream | None = fmt.stream() if fmt is not None else None
        self.tok = tok
        self.tools = tools
        #: the calls read so far, and what could not be read
        self.calls: list[ToolCall] = []
        self.warnings: list[str] = []
        self.texts = {"reasoning": TextStream(tok), "content": TextStream(tok, stops)}
        self.content = ""
        self.reasoning = ""
        self.on_piece: Callable[[dict[str, Any]], None] | None = None
        #: the logprobs of this row's tokens, when asked
        self.recorder = recorder
        #: the steps seen so far (a piece shows the text of at most these)
        self.seen = 0
        #: the channel the reply was in when it ended (``None``: closed, or no chat format)
        self.ended_in: str | None = None
        self.finished = False

    @property
    def hit(self) -> bool:
        return self.texts["content"].hit is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the reply, if one did."""
        return self.texts["content"].hit

    def on_step(self, step: Step | None, piece: str) -> bool:
        if step is not None:
            self.seen += 1
        if self.reply is None:
            if piece:
                self._out({"content": piece})
            return True
        if step is not None:
            self._channels(self.reply.push(step.token))
        return not self.hit

    def finish(self) -> None:
        """The generation is over: release what a chat reply still holds (once)."""
        if self.finished:
            return
        self.finished = True
        if self.reply is not None:
            self.ended_in = None if self.reply.finished else self.reply.channel
            self._channels(self.reply.close())
            if self.tools is not None:
                self._calls(self.tools.finish(cut=not self.reply.closed))

    def _channels(self, parts: list[tuple[str, list[int], bool]]) -> None:
        for name, ids, closed in parts:
            if self.hit:
                return
            if name == "tools":
                if self.tools is not None:
                    self._calls(self.tools.push(ids))
                elif ids:
                    self._calls(Parsed(text=self.tok.decode(ids), warnings=[
                        "the model wrote a tools channel, but this request declares no tools it "
                        "may call; it is returned as text"]))
                continue
            ts = self.texts[name]
            text = "".join(ts.push(i) for i in ids)
            if closed:
                text += ts.finish()
            if text:
                self._out({name: text})

    def _calls(self, got: Parsed) -> None:
        for w in got.warnings:
            if w not in self.warnings:
                self.warnings.append(w)
        if got.text:
            self._out({"content": got.text})
        if got.calls:
            first = len(self.calls)
            self.calls += got.calls
            deltas: list[dict[str, Any]] = []
            for i, c in enumerate(got.calls, start=first):
                deltas.append({"index": i, "id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": ""}})
                deltas.append({"index": i, "function": {"arguments": c.arguments_json()}})
            if self.on_piece is not None:
                self.on_piece({"tool_calls": deltas})

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The calls read, as OpenAI's ``message.tool_calls`` (``None``: none)."""
        if not self.calls:
            return None
        return [{"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments_json()}} for c in self.calls]

    def _out(self, out: dict[str, Any]) -> None:
        self.content += out.get("content", "")
        self.reasoning += out.get("reasoning", "")
        if self.on_piece is not None:
            self.on_piece(out)


@dataclass
class Service:
    worker: Worker
    tok: Tokenizer
    model_name: str
    chat_format: str = "auto"
    thinking: bool = True
    effort: str = "max"
    created: int = field(default_factory=lambda: int(time.time()))
    active: set[Job] = field(default_factory=set)
    stopping: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._formats: dict[str | None, ChatFormat] = {}
        self.fmt = self.format_for(None)  # refuse a bad --chat-format at start, not per request

    @property
    def vocab(self) -> int:
        return int(self.worker.engine.cfg.vocab)

    def format_for(self, effort: str | None) -> ChatFormat:
        """The chat format for a request's ``reasoning_effort`` (``None``: the server's)."""
        fmt = self._formats.get(effort)
        if fmt is None:
            fmt = self._formats[effort] = self._make_format(effort)
        return fmt

    def _make_format(self, effort: str | None) -> ChatFormat:
        thinking, eff = self.thinking, self.effort
        if effort == "none":
            thinking = False
        elif effort is not None:
            thinking, eff = True, effort
        return chat_format_for(self.tok, self.chat_format, thinking=thinking, effort=eff)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.model_name!r} (GET /v1/models)",
                           param="model", code="model_not_found")

    # ---- requests -------------------------------------------------------------------------
    def completion_job(self, req: CompletionRequest) -> Prepared:
        self.check_model(req.model)
        max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        self._check_gen(max_tokens)
        fits = max(self.worker.context - max_tokens, 0)  # the prompt tokens that can fit
        prompt = req.prompt
        if isinstance(prompt, str):
            try:
                ids = self.tok.encode(prompt, limit=fits)
            except TokenLimitExceeded as exc:
                self._too_long(exc, max_tokens, "prompt")
        else:
            if len(prompt) > fits:
                self._context_error(len(prompt), max_tokens, "prompt")
            ids = [int(i) for i in cast("list[int]", prompt)]
            bad = [i for i in ids if not 0 <= i < self.vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary 0..{self.vocab - 1}",
                               param="prompt", code="invalid_value")
        prep = self._prepare("completion", ids, max_tokens, req, list(req.stop_token_ids or []), None,
                             req.logprobs)
        if req.echo:
            prep.echo = prompt if isinstance(prompt, str) else self.tok.decode(ids)
            if req.logprobs is not None:
                prep.prompt_logprobs = PromptRecorder(ids, req.logprobs)
                prep.job.on_prompt_rows = prep.prompt_logprobs.on_rows
        return prep

    def chat_job(self, req: ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        fmt = self.format_for(req.reasoning_effort)
        messages = self._messages(req)
        tools, notes, grammar, names = self._tools(req, fmt)
        limit = req.limit
        if limit is not None:
            self._check_gen(limit)
        fits = max(self.worker.context - (1 if limit is None else limit), 0)
        try:
            if tools or notes:
                ids = render_request(fmt, messages, tools=tools, notes=notes, limit=fits)
            else:
                ids = fmt.render(messages, limit=fits)
        except TokenLimitExceeded as exc:
            self._too_long(exc, 1 if limit is None else limit, "messages")
        if limit is None:
            limit = min(MAX_GEN, self.worker.context - len(ids))
        stop_ids = list(fmt.stop_ids) + list(req.stop_token_ids or [])
        top = (req.top_logprobs or 0) if req.logprobs else None
        return self._prepare("chat", ids, limit, req, stop_ids, fmt, top, grammar=grammar,
                             tool_names=names)

    @staticmethod
    def _messages(req: ChatCompletionRequest) -> list[Message]:
        """The request's messages, tool answers bound to their calls (``k3core.serve.tool_calls``)."""
        pending = []
        for i, m in enumerate(req.messages):
            role = "system" if m.role == "developer" else m.role
            if m.reasoning_content is not None and role != "assistant":
                raise APIError(400, "reasoning_content is only for assistant messages",
                               param="messages", code="invalid_value")
            if role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"messages.{i}: a tool message needs the tool_call_id of the "
                                    "call it answers", param=f"messages.{i}.tool_call_id",
                               code="invalid_value")
            calls = []
            for j, c in enumerate(m.tool_calls or []):
                args: dict[str, Any] | str = c.function.arguments
                if isinstance(args, str) and args.strip():
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None  # kept as the text it is (the encoder's json element)
                    if parsed is not None and not isinstance(parsed, dict):
                        raise APIError(400, f"messages.{i}.tool_calls.{j}.function.arguments must be "
                                            "a JSON object", param=f"messages.{i}.tool_calls",
                                       code="invalid_value")
                    args = parsed if isinstance(parsed, dict) else args
                elif isinstance(args, str):
                    args = {}
                calls.append(ToolCall(c.function.name, args, c.id))
            pending.append(Pending(role, m.text, m.reasoning_content, tuple(calls), m.tool_call_id,
                                   f"messages.{i}"))
        try:
            return bind_answers(pending)
        except UsageError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None

    def _tools(self, req: ChatCompletionRequest, fmt: ChatFormat
               ) -> tuple[list[dict[str, Any]], list[Message], str | None, set[str] | None]:
        """The declared tools (as sent), the notes after the conversation, the grammar the
        reply is constrained to (``None``: free) and the names a call may use (``None``: no
        tools channel is expected)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        functions = [t["function"] for t in tools]
        names = {f["name"] for f in functions}
        if len(names) != len(functions):
            raise APIError(400, "two tools share one name", param="tools", code="invalid_value")
        choice = req.tool_choice
        named = None if choice is None or isinstance(choice, str) else choice.function.name
        if choice is not None and choice not in ("none", "auto") and not tools:
            raise APIError(400, "tool_choice asks for a tool call, but the request declares no tools",
                           param="tool_choice", code="invalid_value")
        if named is not None and named not in names:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not among the "
                                f"tools ({', '.join(sorted(names))})", param="tool_choice",
                           code="invalid_value")
        if tools and not isinstance(fmt, XtmlFormat):
            raise APIError(400, "tools need the XTML chat format; this server renders plain text "
                                "(its tokenizer lacks the XTML control tokens)", param="tools",
                           code="invalid_value")
        forced = choice == "required" or named is not None
        rf = req.response_format
        json_kind = rf.type if rf is not None and rf.type != "text" else None
        if forced and json_kind is not None:
            raise APIError(400, f"tool_choice {'required' if named is None else 'a named function'} "
                                f"and response_format {json_kind} ask for two different replies; "
                                "send one of them", param="response_format", code="invalid_value")
        if (forced or json_kind is not None) and req.spec not in (None, "off"):
            raise APIError(400, "a constrained reply decodes one token a pass: leave spec out "
                                "(or send \"off\")", param="spec", code="invalid_value")
        notes = []
        note = choice_note("required" if forced else choice if isinstance(choice, str) else "auto")
        if note is not None and tools:
            notes.append(note)
        grammar = None
        try:
            if json_kind is not None:
                assert rf is not None
                schema = rf.json_schema.schema_ if rf.json_schema is not None else {"type": "object"}
                notes.append(format_note(json_kind, schema if json_kind == "json_schema" else None))
                grammar = lark_grammar(json_reply(fmt, schema), self.tok, "the response format's grammar")
            elif forced:
                grammar = lark_grammar(forced_calls(fmt, functions, named, req.parallel_tool_calls is not False),
                                       self.tok, "the tool call's grammar")
        except UsageError as exc:
            param = "response_format" if json_kind is not None else "tools"
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
        return tools, notes, grammar, (names if tools and choice != "none" else None)

    @staticmethod
    def _check_gen(max_tokens: int) -> None:
        if max_tokens > MAX_GEN:
            raise APIError(400, f"max_tokens must be at most {MAX_GEN}, got {max_tokens}",
                           param="max_tokens", code="invalid_value")

    def _context_error(self, n_prompt: int, max_tokens: int, param: str) -> NoReturn:
        raise APIError(400, f"this request needs {n_prompt} prompt tokens + {max_tokens} to generate "
                            f"= {n_prompt + max_tokens}, over the model's context of "
                            f"{self.worker.context} tokens; send a shorter prompt or a smaller max_tokens",
                       param=param, code="context_length_exceeded")

    def _too_long(self, exc: TokenLimitExceeded, max_tokens: int, param: str) -> NoReturn:
        """The prompt was found too long before it was tokenized in full."""
        raise APIError(400, f"the prompt holds more than {exc.limit} tokens ({exc.how}): with "
                            f"{max_tokens} to generate it is over the model's context of "
                            f"{self.worker.context} tokens; send a shorter prompt or a smaller max_tokens",
                       param=param, code="context_length_exceeded")

    def _prepare(self, kind: str, ids: list[int], max_tokens: int,
                 req: CompletionRequest | ChatCompletionRequest, stop_ids: list[int],
                 fmt: ChatFormat | None, top: int | None = None, *, grammar: str | None = None,
                 tool_names: set[str] | None = None) -> Prepared:
        """The job and its sinks; ``top``: record each token's logprob and that many
        alternatives (``None``: no logprobs); ``grammar``: each row's reply constrained to it;
        ``tool_names``: the tools a reply may call (its tools channel is read)."""
        if not ids:
            raise APIError(400, "the prompt is empty: nothing to feed the model", param="prompt",
                           code="invalid_value")
        self._check_gen(max_tokens)
        if len(ids) + max_tokens > self.worker.context:
            self._context_error(len(ids), max_tokens, "prompt" if kind == "completion" else "messages")
        bad = [s for s in stop_ids if not 0 <= s < self.vocab]
        if bad:
            raise APIError(400, f"stop token id {bad[0]} is outside the vocabulary 0..{self.vocab - 1}",
                           param="stop_token_ids", code="invalid_value")
        fields = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                  "top_k": req.top_k, "seed": req.seed, "stop_ids": sorted(set(stop_ids)),
                  "ignore_eos": req.ignore_eos, "spec": req.spec,
                  "stop": req.stops if fmt is None else []}  # a chat applies them to its response
        try:
            params = build(GenerationParams, {k: v for k, v in fields.items() if v is not None})
            penalties = Penalties(req.presence_penalty or 0.0, req.frequency_penalty or 0.0, req.bias)
            penalties.check_vocab(self.vocab)
        except UsageError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        xtml = fmt if isinstance(fmt, XtmlFormat) else None
        sinks = [TextSink(self.tok, req.stops, fmt, Recorder(top) if top is not None else None,
                          ToolStream(xtml, tool_names) if xtml is not None and tool_names else None)
                 for _ in range(req.n)]
        job = Job(ids, params, n=req.n)
        if grammar is not None:
            # logprobs and penalties see every id: no forced id may skip the pick
            job.constraint = _constraint(grammar, self.tok,
                                         fast_forward=top is None and not penalties.active)
        job.on_step = _by_row(job, sinks)
        if top is not None or penalties.active:
            job.around = _wraps(sinks, penalties)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return Prepared(job, sinks, len(ids), kind, f"{prefix}-{uuid.uuid4().hex[:24]}",
                        int(time.time()))

    # ---- running ------------------------------------------------------------------------
    def run(self, prep: Prepared) -> Outcome:
        """Run on the worker (blocks; the app calls it on its one engine thread)."""
        out = self.worker.run(prep.job)
        if out.finish != "cancelled":
            for sink in prep.sinks[: len(out.rows)]:
                sink.finish()
        return out

    def admit(self, job: Job) -> None:
        """Count a job in (queued or running); refused once the server is stopping."""
        with self.lock:
            if self.stopping:
                raise APIError(503, "the server is stopping", type_="server_error", code="server_stopping")
            self.active.add(job)

    def release(self, job: Job) -> None:
        with self.lock:
            self.active.discard(job)

    def cancel_all(self) -> None:
        """Stop: cancel every queued and running job, admit no more."""
        with self.lock:
            self.stopping = True
            for job in self.active:
                job.cancel.set()

    def extension(self, prep: Prepared, out: Outcome) -> dict[str, Any]:
        """The ``k3`` field of a response: the ids, the reused prefix, the seed (the first
        row's; with ``n`` > 1 ``rows`` holds each row's ids and seed)."""
        first = out.rows[0].ids if out.rows else out.ids
        ext = {"prompt_ids": prep.job.prompt_ids, "completion_ids": first,
               "reused_tokens": out.reused, "seed": out.seed, "seconds": round(out.seconds, 6)}
        if prep.job.n > 1:
            ext["rows"] = [{"completion_ids": r.ids, "seed": r.seed} for r in out.rows]
        return ext


def thinking_note(sink: TextSink, row: Row, channel: str = "reasoning_content",
                  off: str = 'reasoning_effort "none"') -> str | None:
    """What a chat reply says when ``max_tokens`` ran out in its thinking channel (``None``
    otherwise): no answer was written, and how to get one (``channel`` and ``off``: the
    API's words for the thinking channel and for turning it off)."""
    if row.finish != "length" or sink.ended_in != "reasoning":
        return None
    return (f"max_tokens ran out while the model was thinking: all {len(row.ids)} tokens went to "
            f"{channel} and no answer was written; raise max_tokens, or send {off} to answer "
            "without thinking")


def _constraint(grammar: str, tok: Tokenizer, fast_forward: bool) -> Callable[[int], GrammarConstraint]:
    """Each row's own matcher of ``grammar``; without ``fast_forward`` every id is picked in a
    pass of its own (so logprobs have a row of logits for every token, and the penalties
    count every id)."""

    def make(row: int) -> GrammarConstraint:
        c = GrammarConstraint(grammar, tok)
        c.fast_forward = fast_forward
        return c

    return make


def _by_row(job: Job, sinks: list[TextSink]) -> Callable[[Step | None, str], bool]:
    """A job's ``on_step``: each row's steps to its own sink (``job.row``: the row the
    calling thread decodes); each row's sink is finished when the row ends
    (``job.on_row_done``)."""

    def on_step(step: Step | None, piece: str) -> bool:
        return sinks[job.row].on_step(step, piece)

    job.on_row_done = lambda row: sinks[row].finish()
    return on_step


def _wraps(sinks: list[TextSink], penalties: Penalties) -> Callable[[int], PickWrap]:
    """Each row's pick wrapped: the penalties inside, the logprob recorder outside it (so the
    recorder reads the exact logits)."""

    def around(row: int) -> PickWrap:
        rec = sinks[row].recorder

        def wrap(pick: Callable[[np.ndarray], int]) -> Callable[[np.ndarray], int]:
            inner = penalties.wrap(pick)
            return rec.wrap(inner) if rec is not None else inner

        return wrap

    return around
