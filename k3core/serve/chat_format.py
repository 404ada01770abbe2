"""Chat formats: the Kimi K3 XTML transcript, and plain text for tokenizers without it.

**XTML** is how the released model frames a conversation. Four control tokens, ``<|open|>``,
``<|close|>``, ``<|sep|>`` and ``<|end_of_msg|>``, frame every message::

    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>

An assistant message holds a think channel (when thinking is on) and a response channel::

    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>REASONING<|close|>think<|sep|>
    <|open|>response<|sep|>TEXT<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>

After the response channel an assistant message may hold a tools channel, its tool calls
(the official encoder's shape; docs/server.md cites where it is published)::

    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
    <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>...
    <|close|>call<|sep|>...<|close|>tools<|sep|>

``TYPE`` is the argument's JSON type; a string VALUE is written as it is, any other as JSON
(arguments that are not a JSON object are written whole in a ``json`` element). A tool's
answer is a message ``role="tool" tool="NAME" index="I"`` (``I`` the call's place in the
assistant message). Attribute values escape ``&`` and ``"``; a system message may carry a
``type`` (``tool-declare``, ``tool-choice``, ``response-format``: ``k3core.serve.tool_calls``).

With thinking on, the transcript starts with a system message of type ``thinking-effort``
naming the effort (``low``, ``high`` or ``max``; ``medium`` is refused, as the checkpoint's
own encoder refuses it). With thinking off, assistant messages carry no think channel, even
when the history holds reasoning. The generation prompt opens an assistant message and its
first channel (think, or response with thinking off). The model ends its turn with ``[EOS]``
(what the released model emits) or ``<|end_of_msg|>``; both are stop ids.

Every piece is encoded on its own: a control token as its id, everything else (tag names,
attributes, text) with special tokens disabled, so text that spells ``<|end_of_msg|>`` is
ordinary text and can never inject a control id. BPE never merges across pieces, so the
attribute string is one piece, as the reference encoder has it.

``render`` and ``turn`` take a ``limit``: a transcript that would hold more tokens raises
:class:`~k3core.tokenizer.encoding.TokenLimitExceeded` as soon as that is known (a text too
long to fit is refused before it is tokenized, and tokenizing stops at the limit), so an
oversized request costs no more than the limit's worth of work.

**Plain** is for tokenizers that do not name the XTML control tokens: ``Role: text`` blocks
separated by a blank line, the generation prompt ``Assistant:``, and ``[EOS]`` (if the
tokenizer names it) as the stop id.

:func:`chat_format_for` picks XTML when the tokenizer names all four control tokens (the
released tokenizer and every ``k3 synth`` tokenizer do) and plain otherwise; either can be
forced by name.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3core.api.errors import UsageError
from k3core.tokenizer.encoding import TokenBudget, Tokenizer, TokenLimitExceeded

ROLES = ("system", "user", "assistant", "tool")
EFFORTS = ("low", "high", "max")
FORMATS = ("auto", "xtml", "plain")
OPEN, CLOSE, SEP, EOM, EOS = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"

_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool: its name, its arguments (an object, or the text of arguments that
    are not one) and the id a client binds the answer with."""

    name: str
    arguments: dict[str, Any] | str
    id: str | None = None

    def arguments_json(self) -> str:
        """The arguments as OpenAI sends them: JSON text."""
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Message:
    """One message of a conversation; ``reasoning`` and ``tool_calls`` only on an assistant
    message; ``tool`` (the tool's name) and ``index`` (its call's place, from 1) on a tool's
    answer; ``kind`` (the ``type`` attribute) only on a system message."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool: str | None = None
    index: int | None = None
    kind: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UsageError(f"unknown message role {self.role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise UsageError(f"a {self.role} message's content must be text")
        if self.reasoning is not None and self.role != "assistant":
            raise UsageError("only an assistant message may carry reasoning")
        if self.tool_calls and self.role != "assistant":
            raise UsageError("only an assistant message may carry tool calls")
        if self.role == "tool" and (not self.tool or self.index is None):
            raise UsageError("a tool message needs the tool's name and its call's index")
        if self.kind is not None and self.role != "system":
            raise UsageError("only a system message may carry a type")


@dataclass(frozen=True)
class Reply:
    """What a generated reply says: its text, its reasoning, and how it ended; ``tools`` holds
    the ids of its tools channel (XTML), read by ``k3core.serve.tool_calls``."""

    content: str
    reasoning: str | None
    finished: bool  # the last id is a stop id
    well_formed: bool  # the channels closed as the format expects, then one end id
    tools: tuple[int, ...] = ()


class ChatFormat:
    """A chat format over one tokenizer (the base holds what both formats share)."""

    name = "base"
    _budget: TokenBudget | None = None

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.stop_ids: tuple[int, ...] = ()

    # ---- rendering ----------------------------------------------------------------------
    def within(self, limit: int) -> ChatFormat:
        """A copy of this format that renders at most ``limit`` tokens (then raises
        :class:`TokenLimitExceeded`); the format itself is left as it is."""
        fmt = copy.copy(self)
        fmt._budget = TokenBudget(limit)
        return fmt

    def checked(self, ids: list[int]) -> list[int]:
        """``ids`` so far, counted against the budget (a no-op without one)."""
        budget = self._budget
        if budget is not None:
            budget.used = max(budget.used, len(ids))
            if len(ids) > budget.limit:
                raise TokenLimitExceeded(budget.limit, len(ids),
                                         f"the transcript reached {len(ids):,} tokens")
        return ids

    def text(self, s: str) -> list[int]:
        """Ordinary text: special tokens disabled."""
        return self.tok.encode(s, allow_special=False, limit=self._budget) if s else []

    def preamble(self) -> list[int]:
        """Ids before the first message."""
        return []

    def message(self, m: Message) -> list[int]:
        raise NotImplementedError

    def generation_prompt(self) -> list[int]:
        raise NotImplementedError

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               limit: int | None = None) -> list[int]:
        """The whole transcript: preamble, every message, and (by default) the generation prompt."""
        if limit is not None:
            return self.within(limit).render(messages, add_generation_prompt)
        ids = self.checked(self.preamble())
        for m in messages:
            ids += self.message(m)
            self.checked(ids)
        if add_generation_prompt:
            ids += self.generation_prompt()
        return self.checked(ids)

    def turn(self, messages: Sequence[Message], limit: int | None = None) -> list[int]:
        """What a later turn appends to a carried conversation: its messages, then the prompt."""
        if limit is not None:
            return self.within(limit).turn(messages)
        ids: list[int] = []
        for m in messages:
            ids += self.message(m)
            self.checked(ids)
        ids += self.generation_prompt()
        return self.checked(ids)

    # ---- reading a reply ---------------------------------------------------------------
    def parse_reply(self, ids: Sequence[int]) -> Reply:
        raise NotImplementedError

    def close_reply(self, ids: Sequence[int]) -> list[int]:
        """Ids that end an unfinished reply (cut by max_tokens or Ctrl-C); none if it ended."""
        raise NotImplementedError

    def stream(self) -> ReplyStream:
        """A streaming reader of a reply, for text that arrives a token at a time."""
        return ReplyStream(self)

    def channels(self) -> list[tuple[str, list[tuple[list[int], str | None]]]]:
        """Each channel in reply order with the id patterns that end it, each naming the
        channel it opens (``None``: the reply is closed); used by :class:`ReplyStream`."""
        raise NotImplementedError

    def is_stop(self, token: int) -> bool:
        return token in self.stop_ids


class XtmlFormat(ChatFormat):
    """The Kimi K3 XTML transcript (module docstring)."""

    name = "xtml"

    def __init__(self, tok: Tokenizer, thinking: bool = True, effort: str = "max"):
        super().__init__(tok)
        names = tok.special_tokens
        missing = [t for t in (OPEN, CLOSE, SEP, EOM) if t not in names]
        if missing:
            raise UsageError(f"the tokenizer lacks the XTML control tokens {', '.join(missing)}; "
                             "use the plain chat format")
        if thinking and effort not in EFFORTS:
            raise UsageError(f"thinking effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
        self.thinking = thinking
        self.effort = effort
        self.open_id, self.close_id = names[OPEN], names[CLOSE]
        self.sep_id, self.eom_id = names[SEP], names[EOM]
        self.eos_id = names.get(EOS)
        self.stop_ids = (self.eom_id,) + ((self.eos_id,) if self.eos_id is not None else ())
        # the id patterns a reply is read by
        self.think_to_response = self._close("think") + self._open("response")
        self.think_to_tools = self._close("think") + self._open("tools")
        self.response_end = self._close("response") + self._close("message")
        self.response_to_tools = self._close("response") + self._open("tools")
        self.tools_end = self._close("tools") + self._close("message")

    def _open(self, tag: str, attrs: str = "") -> list[int]:
        return [self.open_id] + self.text(tag) + self.text(attrs) + [self.sep_id]

    def _close(self, tag: str) -> list[int]:
        return [self.close_id] + self.text(tag) + [self.sep_id]

    def open_tag(self, tag: str, attrs: Sequence[tuple[str, object]] = ()) -> list[int]:
        """``<|open|>tag key="value" ...<|sep|>``: as the official encoder writes it, each
        fragment its own piece (`` key``, ``="``, the escaped value, ``"``)."""
        ids = [self.open_id] + self.text(tag)
        for key, value in attrs:
            ids += self.text(f" {key}") + self.text('="') + self.text(attr_value(value)) + self.text('"')
        return ids + [self.sep_id]

    def tools_channel(self, calls: Sequence[ToolCall]) -> list[int]:
        """An assistant message's tools channel (module docstring)."""
        ids = self._open("tools")
        for i, call in enumerate(calls, start=1):
            ids += self.open_tag("call", [("tool", call.name), ("index", i)])
            if isinstance(call.arguments, str):
                ids += (self.open_tag("json", [("type", "object")]) + self.text(call.arguments)
                        + self._close("json"))
            else:
                for key, value in call.arguments.items():
                    ids += (self.open_tag("argument", [("key", key), ("type", json_type(value))])
                            + self.text(value if isinstance(value, str)
                                        else json.dumps(value, ensure_ascii=False))
                            + self._close("argument"))
            ids += self._close("call")
            self.checked(ids)
        return ids + self._close("tools")

    def preamble(self) -> list[int]:
        if not self.thinking:
            return []
        return (self._open("message", ' role="system" type="thinking-effort"')
                + self.text(_EFFORT_TEXT.format(self.effort)) + self._close("message") + [self.eom_id])

    def message(self, m: Message) -> list[int]:
        if m.role == "tool":
            ids = self.open_tag("message", [("role", "tool"), ("tool", m.tool), ("index", m.index)])
        elif m.kind is not None:
            ids = self.open_tag("message", [("role", "system"), ("type", m.kind)])
        else:
            ids = self._open("message", f' role="{m.role}"')
        if m.role == "assistant":
            if self.thinking:
                ids += self._open("think") + self.text(m.reasoning or "") + self._close("think")
            ids += self._open("response") + self.text(m.content) + self._close("response")
            if m.tool_calls:
                ids += self.tools_channel(m.tool_calls)
        else:
            ids += self.text(m.content)
        return ids + self._close("message") + [self.eom_id]

    def generation_prompt(self) -> list[int]:
        return self._open("message", ' role="assistant"') + self._open("think" if self.thinking else "response")

    def channels(self) -> list[tuple[str, list[tuple[list[int], str | None]]]]:
        ends = list[tuple[list[int], str | None]]
        content: tuple[str, ends] = ("content", [(self.response_end, None),
                                                 (self.response_to_tools, "tools")])
        tools: tuple[str, ends] = ("tools", [(self.tools_end, None)])
        if self.thinking:
            return [("reasoning", [(self.think_to_response, "content"), (self.think_to_tools, "tools")]),
                    content, tools]
        return [content, tools]

    def parse_reply(self, ids: Sequence[int]) -> Reply:
        ids = list(ids)
        finished = bool(ids) and self.is_stop(ids[-1])
        reader = self.stream()
        parts: dict[str, list[int]] = {}
        for t in ids:
            for name, got, _ in reader.push(t):
                parts.setdefault(name, []).extend(got)
        for name, got, _ in reader.close():
            parts.setdefault(name, []).extend(got)
        reasoning = self.tok.decode(parts.get("reasoning", [])) if self.thinking else None
        body = parts.get("content", [])
        special = self.tok.special_ids
        ok = (reader.closed and not reader.extra and finished
              and not any(t in special for t in body))
        return Reply(self.tok.decode(body), reasoning, finished, ok, tuple(parts.get("tools", [])))

    def close_reply(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if ids and self.is_stop(ids[-1]):
            return []
        reader = self.stream()
        tools: list[int] = []
        for t in ids:
            for name, got, _ in reader.push(t):
                if name == "tools":
                    tools += got
        at, held = reader.channel, reader.held
        if at == "tools":
            if held and self.tools_end[:len(held)] == held:  # cut inside the closing pattern
                return self.tools_end[len(held):] + [self.eom_id]
            return self._close_open_tags(tools + held) + self.tools_end + [self.eom_id]
        ends = dict(self.channels())
        out: list[int] = []
        while at is not None and at != "tools":
            # finish the ending pattern the held ids began (the first one, if none)
            pattern, following = next(((p, f) for p, f in ends[at] if held and p[:len(held)] == held),
                                      ends[at][0])
            out += pattern[len(held):] if held and pattern[:len(held)] == held else pattern
            held, at = [], following
        if at == "tools":  # the pattern opened the tools channel: close it empty
            out += self.tools_end
        return out + [self.eom_id]

    def _close_open_tags(self, ids: Sequence[int]) -> list[int]:
        """The ids that close every tag left open in a cut tools channel, innermost first."""
        stack: list[str] = []
        out: list[int] = []
        i = 0
        while i < len(ids):
            if ids[i] == self.open_id:
                j = i + 1
                while j < len(ids) and ids[j] != self.sep_id:
                    j += 1
                stack.append(self.tok.decode(ids[i + 1:j]).split(" ")[0])
                if j == len(ids):  # cut inside the opening tag
                    out.append(self.sep_id)
                i = j + 1
            elif ids[i] == self.close_id:
                if stack:
                    stack.pop()
                j = i + 1
                while j < len(ids) and ids[j] != self.sep_id:
                    j += 1
                if j == len(ids):  # cut inside a closing tag: finish it as written
                    return out + [self.sep_id] + [t for tag in reversed(stack) for t in self._close(tag)]
                i = j + 1
            else:
                i += 1
        return out + [t for tag in reversed(stack) for t in self._close(tag)]


class PlainFormat(ChatFormat):
    """``Role: text`` blocks for tokenizers without the XTML control tokens."""

    name = "plain"
    TITLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}

    def __init__(self, tok: Tokenizer):
        super().__init__(tok)
        eos = tok.special_tokens.get(EOS)
        self.stop_ids = (eos,) if eos is not None else ()

    def message(self, m: Message) -> list[int]:
        if m.role == "assistant":  # the same pieces a live reply is made of
            return self.generation_prompt() + self.text(m.content) + self.text("\n\n")
        return self.text(f"{self.TITLES[m.role]}: {m.content}\n\n")

    def generation_prompt(self) -> list[int]:
        return self.text("Assistant:")

    def channels(self) -> list[tuple[str, list[tuple[list[int], str | None]]]]:
        return [("content", [])]

    def parse_reply(self, ids: Sequence[int]) -> Reply:
        ids = list(ids)
        finished = bool(ids) and self.is_stop(ids[-1])
        body = ids[:-1] if finished else ids
        return Reply(self.tok.decode(body), None, finished, finished)

    def close_reply(self, ids: Sequence[int]) -> list[int]:
        return [] if ids and self.is_stop(ids[-1]) else self.text("\n\n")


class ReplyStream:
    """Reads a reply a token at a time and sorts its ids into channels.

    ``push`` returns ``[(channel, ids, closed)]``: the ids released to a channel's text, and
    whether that channel has just ended. Ids that might be the start of a pattern ending
    the current channel are held back until they turn out to be text or the pattern, so an
    id once released is never taken back, and the released ids of each channel are exactly
    what :meth:`ChatFormat.parse_reply` reads as that channel. A channel may end in several
    ways (XTML's response channel closes the message, or opens the tools channel).
    """

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        channels = fmt.channels()
        self._ends = dict(channels)
        self._current: str | None = channels[0][0] if channels else None
        self._held: list[int] = []
        self.finished = False
        self.closed = False  # the reply's closing pattern arrived
        self.extra = 0  # ids after the closing pattern other than the end id

    @property
    def channel(self) -> str | None:
        return self._current

    @property
    def held(self) -> list[int]:
        """Ids held back in the current channel (they may start its closing pattern)."""
        return list(self._held)

    def push(self, token: int) -> list[tuple[str, list[int], bool]]:
        if self.finished:
            return []
        if self.fmt.is_stop(token):
            self.finished = True
            return self.close()
        name = self._current
        if name is None:
            self.extra += self.closed  # after the closure only the end id is expected
            return []
        ends = self._ends[name]
        held = self._held
        held.append(token)
        for pattern, following in ends:
            if pattern and len(held) >= len(pattern) and held[-len(pattern):] == pattern:
                ids, self._held = held[: -len(pattern)], []
                self._current = following
                self.closed = following is None
                return [(name, ids, True)]
        keep = max((_held_suffix(held, pattern) for pattern, _ in ends), default=0)
        ids, self._held = held[: len(held) - keep], held[len(held) - keep:]
        return [(name, ids, False)] if ids else []

    def close(self) -> list[tuple[str, list[int], bool]]:
        """The reply ended (its end id, or cut short): release what is held."""
        name = self._current
        if name is None:
            return []
        ids, self._held = self._held, []
        self._current = None
        return [(name, ids, True)]


def _held_suffix(ids: Sequence[int], pattern: Sequence[int]) -> int:
    """Length of the longest suffix of ``ids`` that is a proper prefix of ``pattern``."""
    for k in range(min(len(ids), len(pattern) - 1), 0, -1):
        if list(ids[-k:]) == list(pattern[:k]):
            return k
    return 0


def check_format_options(name: str, thinking: bool, effort: str) -> None:
    """Refuse a bad format name or effort before anything is opened."""
    if name not in FORMATS:
        raise UsageError(f"unknown chat format {name!r}; choose one of {', '.join(FORMATS)}")
    if thinking and effort not in EFFORTS:
        raise UsageError(f"thinking effort must be one of {', '.join(EFFORTS)}, got {effort!r}")


def chat_format_for(tok: Tokenizer, name: str = "auto", thinking: bool = True,
                    effort: str = "max") -> ChatFormat:
    """The chat format called ``name`` (``auto``: XTML when the tokenizer has its tokens)."""
    check_format_options(name, thinking, effort)
    if name == "auto":
        names = tok.special_tokens
        name = "xtml" if all(t in names for t in (OPEN, CLOSE, SEP, EOM)) else "plain"
    if name == "xtml":
        return XtmlFormat(tok, thinking=thinking, effort=effort)
    return PlainFormat(tok)


def attr_value(value: object) -> str:
    """An XTML attribute value: ``&`` then ``"`` escaped (``<`` and ``>`` are text here)."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def json_type(value: object) -> str:
    """An argument's ``type`` attribute: its JSON type (a boolean before a number)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"
