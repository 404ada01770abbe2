"""Tool calls in the Kimi K3 format: what a request declares, and what the model calls.

The shapes are the official encoder's (``encoding_k3.py`` in the Kimi K3 release; the
sources are cited in docs/server.md, "Tool calls"):

* the tools a request declares go first, in a system message of type ``tool-declare``:
  ``# Tools`` and the OpenAI tool objects as compact JSON, every object's keys sorted;
* ``tool_choice`` ``required`` (or a named function) and ``none`` add a system message of
  type ``tool-choice`` after the conversation; ``response_format`` ``json_object`` and
  ``json_schema`` one of type ``response-format`` (the schema as compact sorted JSON);
* an assistant message's ``tool_calls`` become its tools channel, and a ``role: "tool"``
  message becomes ``role="tool" tool="NAME" index="I"``, its name and index found by its
  ``tool_call_id`` among the calls of the assistant message before it (a run of tool
  answers is put in the order of those calls, as the encoder does);
* the model's tools channel is read back at the level of ids (the control tokens are ids,
  everything between them text), into :class:`~k3core.serve.chat_format.ToolCall` objects:
  :func:`parse_tools` for a whole reply and :class:`ToolStream` for one that arrives a token
  at a time. A call that does not read as one (a missing close, an argument of the wrong
  type, a tool nobody declared) is returned as its text, with a warning, never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from k3core.api.errors import UsageError
from k3core.serve.chat_format import ChatFormat, Message, ToolCall, XtmlFormat

#: OpenAI's rule for a function's name
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

TOOLS_TEXT = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\n"
                "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
            "You MUST NOT call any tools in the next message.",
}
JSON_TEXT = ("The system is invoked with `response_format={}`.\nYour response must be raw JSON "
             "data without markdown code blocks (```json) or any additional formatting.")
SCHEMA_TEXT = "\nThe JSON data must match the following schema:\n```json\n{}\n```"


def compact(value: Any) -> str:
    """JSON as the encoder writes it into a prompt: compact, keys sorted at every level."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def declaration(tools: Sequence[dict[str, Any]]) -> Message:
    """The ``tool-declare`` system message for the tools a request declares."""
    return Message("system", TOOLS_TEXT.format(compact(list(tools))), kind="tool-declare")


def choice_note(choice: str) -> Message | None:
    """The ``tool-choice`` note for ``required`` (a named function too) or ``none``."""
    text = CHOICE_TEXT.get(choice)
    return Message("system", text, kind="tool-choice") if text else None


def format_note(kind: str, schema: dict[str, Any] | None = None) -> Message:
    """The ``response-format`` note for ``json_object`` or ``json_schema``."""
    text = JSON_TEXT.format(kind) + (SCHEMA_TEXT.format(compact(schema)) if kind == "json_schema" else "")
    return Message("system", text, kind="response-format")


def render_request(fmt: ChatFormat, messages: Sequence[Message], *, tools: Sequence[dict[str, Any]] = (),
                   notes: Sequence[Message] = (), limit: int | None = None) -> list[int]:
    """A request's whole transcript: the tool declaration, the preamble, the messages, the
    notes (tool choice, response format) and the generation prompt; ``limit`` as for
    :meth:`ChatFormat.render` (raises ``TokenLimitExceeded``)."""
    f = fmt.within(limit) if limit is not None else fmt
    ids = f.checked(f.message(declaration(tools)) if tools else [])
    ids += f.preamble()
    for m in [*messages, *notes]:
        ids += f.message(m)
        f.checked(ids)
    ids += f.generation_prompt()
    return f.checked(ids)


# ---- the conversation's tool messages ---------------------------------------------------------
@dataclass
class Pending:
    """A message of the request before its tool answers are bound: role, text, and either the
    assistant's calls or the answer's ``tool_call_id``."""

    role: str
    content: str
    reasoning: str | None = None
    calls: tuple[ToolCall, ...] = ()
    call_id: str | None = None
    where: str = ""  # "messages.3", for an error


def bind_answers(pending: Sequence[Pending]) -> list[Message]:
    """Messages with every tool answer bound to its call: the tool's name and the call's
    index, found by ``tool_call_id`` among the calls of the assistant message before it;
    each run of answers in the order of those calls. An id that matches no call is refused."""
    out: list[Message] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(pending):
        m = pending[i]
        if m.role != "tool":
            if m.role == "assistant":
                calls = {}
                for pos, c in enumerate(m.calls, start=1):
                    if c.id is not None:
                        calls.setdefault(c.id, (pos, c.name))
            out.append(Message(m.role, m.content, m.reasoning, m.calls))
            i += 1
            continue
        run: list[tuple[int, int, Message]] = []
        while i < len(pending) and pending[i].role == "tool":
            t = pending[i]
            found = calls.get(t.call_id or "")
            if found is None:
                known = ", ".join(repr(k) for k in calls) or "none"
                raise UsageError(f"{t.where}: tool_call_id {t.call_id!r} matches no tool call of "
                                 f"the assistant message before it (its calls: {known})")
            pos, name = found
            run.append((pos, len(run), Message("tool", t.content, tool=name, index=pos)))
            i += 1
        out += [msg for _, _, msg in sorted(run, key=lambda r: (r[0], r[1]))]
    return out


# ---- reading the model's calls ----------------------------------------------------------------
@dataclass
class Parsed:
    """What a tools channel (or a part of one) said: the calls read, the text of what did not
    read as a call, and why."""

    calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    warnings: list[str] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _Elements:
    """A tools channel's ids as elements: ``("open", tag, attrs)``, ``("close", tag)`` and
    ``("text", str)``; an opening or closing tag cut before its ``<|sep|>`` is ``("cut",)``.
    ``spans[k]`` is where element ``k``'s ids start and end."""

    def __init__(self, fmt: XtmlFormat, ids: Sequence[int]):
        self.items: list[tuple[Any, ...]] = []
        self.spans: list[tuple[int, int]] = []
        tok = fmt.tok
        i, n = 0, len(ids)
        while i < n:
            t = ids[i]
            if t in (fmt.open_id, fmt.close_id):
                j = i + 1
                while j < n and ids[j] != fmt.sep_id:
                    j += 1
                if j == n:
                    self.items.append(("cut",))
                    self.spans.append((i, n))
                    return
                inner = tok.decode(ids[i + 1:j])
                if t == fmt.open_id:
                    tag, _, rest = inner.partition(" ")
                    self.items.append(("open", tag, _attrs(rest)))
                else:
                    self.items.append(("close", inner))
                self.spans.append((i, j + 1))
                i = j + 1
                continue
            j = i
            while j < n and ids[j] not in (fmt.open_id, fmt.close_id):
                j += 1
            self.items.append(("text", tok.decode(ids[i:j])))
            self.spans.append((i, j))
            i = j


def _attrs(text: str) -> dict[str, str] | None:
    """``key="value" ...`` (values unescaped); None if ``text`` is not only attributes."""
    out: dict[str, str] = {}
    pos = 0
    for m in re.finditer(r'\s*([A-Za-z_][\w-]*)="([^"]*)"', text):
        if m.start() != pos:
            return None
        out[m.group(1)] = m.group(2).replace("&quot;", '"').replace("&amp;", "&")
        pos = m.end()
    return out if text[pos:].strip() == "" else None


class _Malformed(Exception):
    pass


def _value(kind: str | None, text: str) -> Any:
    if kind == "string":
        return text
    try:
        value = json.loads(text)
    except ValueError:
        if kind is None:
            return text
        raise _Malformed(f"an argument of type {kind} is not JSON: {text[:40]!r}") from None
    want = {"number": (int, float), "boolean": (bool,), "null": (type(None),), "object": (dict,),
            "array": (list,)}.get(kind or "")
    if want is not None and (not isinstance(value, want)
                             or (kind == "number" and isinstance(value, bool))):
        raise _Malformed(f"an argument of type {kind} holds {text[:40]!r}")
    return value


def _read_call(items: list[tuple[Any, ...]], names: set[str] | None) -> ToolCall:
    """One whole call's elements (its opening tag to its closing tag) as a ToolCall."""
    head = items[0]
    attrs = head[2] or {}
    name = attrs.get("tool")
    if not name:
        raise _Malformed("a call without a tool name")
    if names is not None and name not in names:
        raise _Malformed(f"a call of {name!r}, which the request does not declare")
    args: dict[str, Any] | str = {}
    body = items[1:-1]
    i = 0
    while i < len(body):
        it = body[i]
        if it[0] == "text" and not it[1].strip():
            i += 1
            continue
        if it[0] != "open" or it[1] not in ("argument", "json") or it[2] is None:
            raise _Malformed(f"unexpected {it[0]} {it[1] if len(it) > 1 else ''!r} in a call of {name!r}")
        tag = it[1]
        text = ""
        if i + 1 < len(body) and body[i + 1][0] == "text":
            text = body[i + 1][1]
            i += 1
        if i + 1 >= len(body) or body[i + 1] != ("close", tag):
            raise _Malformed(f"an unclosed {tag} in a call of {name!r}")
        i += 2
        if tag == "json":
            try:
                value = json.loads(text)
            except ValueError:
                raise _Malformed(f"the arguments of {name!r} are not JSON") from None
            if not isinstance(value, dict) or args:
                raise _Malformed(f"the arguments of {name!r} are not one JSON object")
            args = text
            continue
        key = it[2].get("key")
        if key is None or isinstance(args, str) or key in args:
            raise _Malformed(f"an argument without a key, or twice, in a call of {name!r}")
        args[key] = _value(it[2].get("type"), text)
    if isinstance(args, str):
        args = json.loads(args)
    return ToolCall(name, args, new_call_id())


def parse_tools(fmt: XtmlFormat, ids: Sequence[int], names: set[str] | None = None,
                cut: bool = False) -> Parsed:
    """Read a tools channel's ids (without its opening ``<|open|>tools<|sep|>``); ``names``:
    the tools the request declares (``None``: any name); ``cut``: the reply stopped inside
    it. Calls that do not read come back as text with a warning."""
    out = Parsed()
    elements = _Elements(fmt, ids)
    items, spans = elements.items, elements.spans
    i = 0
    while i < len(items):
        it = items[i]
        if it[0] == "text" and not it[1].strip():
            i += 1
            continue
        if it[0] == "open" and it[1] == "call":
            j = next((k for k in range(i + 1, len(items)) if items[k] == ("close", "call")), None)
            if j is not None:
                try:
                    out.calls.append(_read_call(items[i:j + 1], names))
                    i = j + 1
                    continue
                except _Malformed as e:
                    out.warnings.append(f"the model's tool call could not be read ({e}); "
                                        "it is returned as text")
                    out.text += fmt.tok.decode(ids[spans[i][0]:spans[j][1]])
                    i = j + 1
                    continue
        rest = fmt.tok.decode(ids[spans[i][0]:])
        why = "the reply stopped inside its tools channel" if cut else "the tools channel does not read as calls"
        out.warnings.append(f"{why}; the rest of it is returned as text")
        out.text += rest
        break
    return out


class ToolStream:
    """A tools channel read as it arrives: :meth:`push` takes its ids and returns what is new,
    a whole call as soon as its closing tag arrives (or its text, if it does not read);
    :meth:`finish` reads what is left when the reply ends."""

    def __init__(self, fmt: XtmlFormat, names: set[str] | None = None):
        self.fmt = fmt
        self.names = names
        self.ids: list[int] = []
        self.calls: list[ToolCall] = []
        self.warnings: list[str] = []
        self._close = fmt._close("call")

    def push(self, ids: Sequence[int]) -> Parsed:
        out = Parsed()
        for t in ids:
            self.ids.append(t)
            if self.ids[-len(self._close):] == self._close:
                got = parse_tools(self.fmt, self.ids, self.names)
                self.ids = []
                self._take(got, out)
        return out

    def finish(self, cut: bool) -> Parsed:
        out = Parsed()
        if self.ids:
            got = parse_tools(self.fmt, self.ids, self.names, cut=cut)
            self.ids = []
            self._take(got, out)
        return out

    def _take(self, got: Parsed, out: Parsed) -> None:
        self.calls += got.calls
        self.warnings += got.warnings
        out.calls += got.calls
        out.text += got.text
        out.warnings += got.warnings
