"""Chat formats: the Kimi K3 XTML transcript, and plain text for tokenizers without it.

**XTML** is how the released model frames a conversation. Four control tokens, ``<|open|>``,
``<|close|>``, ``<|sep|>`` and ``<|end_of_msg|>``, frame every message::

    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>

An assistant message holds a think channel (when thinking is on) and a response channel::

    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>REASONING<|close|>think<|sep|>
    <|open|>response<|sep|>TEXT<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>

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
from collections.abc import Sequence
from dataclasses import dataclass

from k3core.api.errors import UsageError
from k3core.tokenizer.encoding import TokenBudget, Tokenizer, TokenLimitExceeded

ROLES = ("system", "user", "assistant")
EFFORTS = ("low", "high", "max")
FORMATS = ("auto", "xtml", "plain")
OPEN, CLOSE, SEP, EOM, EOS = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"

_EFFORT_TEXT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)


@dataclass(frozen=True)
class Message:
    """One message of a conversation; ``reasoning`` only on an assistant message."""

    role: str
    content: str
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UsageError(f"unknown message role {self.role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise UsageError(f"a {self.role} message's content must be text")
        if self.reasoning is not None and self.role != "assistant":
            raise UsageError("only an assistant message may carry reasoning")


@dataclass(frozen=True)
class Reply:
    """What a generated reply says: its text, its reasoning, and how it ended."""

    content: str
    reasoning: str | None
    finished: bool  # the last id is a stop id
    well_formed: bool  # the channels closed as the format expects, then one end id


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

    def channels(self) -> list[tuple[str, list[int]]]:
        """(channel, the id pattern that ends it) in reply order; used by :class:`ReplyStream`."""
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
        self.response_end = self._close("response") + self._close("message")

    def _open(self, tag: str, attrs: str = "") -> list[int]:
        return [self.open_id] + self.text(tag) + self.text(attrs) + [self.sep_id]

    def _close(self, tag: str) -> list[int]:
        return [self.close_id] + self.text(tag) + [self.sep_id]

    def preamble(self) -> list[int]:
        if not self.thinking:
            return []
        return (self._open("message", ' role="system" type="thinking-effort"')
                + self.text(_EFFORT_TEXT.format(self.effort)) + self._close("message") + [self.eom_id])

    def message(self, m: Message) -> list[int]:
        ids = self._open("message", f' role="{m.role}"')
        if m.role == "assistant":
            if self.thinking:
                ids += self._open("think") + self.text(m.reasoning or "") + self._close("think")
            ids += self._open("response") + self.text(m.content) + self._close("response")
        else:
            ids += self.text(m.content)
        return ids + self._close("message") + [self.eom_id]

    def generation_prompt(self) -> list[int]:
        return self._open("message", ' role="assistant"') + self._open("think" if self.thinking else "response")

    def channels(self) -> list[tuple[str, list[int]]]:
        if self.thinking:
            return [("reasoning", self.think_to_response), ("content", self.response_end)]
        return [("content", self.response_end)]

    def parse_reply(self, ids: Sequence[int]) -> Reply:
        ids = list(ids)
        finished = bool(ids) and self.is_stop(ids[-1])
        body = ids[:-1] if finished else ids
        reasoning: str | None = None
        ok = True
        if self.thinking:
            split = _find(body, self.think_to_response)
            if split < 0:
                return Reply("", self.tok.decode(body), finished, False)
            reasoning = self.tok.decode(body[:split])
            body = body[split + len(self.think_to_response):]
        end = _find(body, self.response_end)
        if end < 0:
            ok = False
        else:
            ok = end + len(self.response_end) == len(body)
            body = body[:end]
        special = self.tok.special_ids
        ok = ok and finished and not any(t in special for t in body)
        return Reply(self.tok.decode(body), reasoning, finished, ok)

    def close_reply(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if ids and self.is_stop(ids[-1]):
            return []
        out: list[int] = []
        at = 0
        if self.thinking:
            split = _find(ids, self.think_to_response)
            if split < 0:
                out += self.think_to_response
                at = len(ids)
            else:
                at = split + len(self.think_to_response)
        if _find(ids[at:], self.response_end) < 0:
            out += self.response_end
        return out + [self.eom_id]


class PlainFormat(ChatFormat):
    """``Role: text`` blocks for tokenizers without the XTML control tokens."""

    name = "plain"
    TITLES = {"system": "System", "user": "User", "assistant": "Assistant"}

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

    def channels(self) -> list[tuple[str, list[int]]]:
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
    whether that channel has just ended. Ids that might be the start of the pattern ending
    the current channel are held back until they turn out to be text or the pattern, so an
    id once released is never taken back, and the released ids of each channel are exactly
    what :meth:`ChatFormat.parse_reply` reads as that channel.
    """

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        self._channels = fmt.channels()
        self._at = 0  # index into _channels; len() once the reply is closed
        self._held: list[int] = []
        self.finished = False

    @property
    def channel(self) -> str | None:
        return self._channels[self._at][0] if self._at < len(self._channels) else None

    def push(self, token: int) -> list[tuple[str, list[int], bool]]:
        if self.finished:
            return []
        if self.fmt.is_stop(token):
            self.finished = True
            return self.close()
        if self._at >= len(self._channels):
            return []  # after the closure only the end id is expected
        name, pattern = self._channels[self._at]
        self._held.append(token)
        if pattern and len(self._held) >= len(pattern) and self._held[-len(pattern):] == pattern:
            ids, self._held = self._held[: -len(pattern)], []
            self._at += 1
            return [(name, ids, True)]
        keep = _held_suffix(self._held, pattern)
        ids, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        return [(name, ids, False)] if ids else []

    def close(self) -> list[tuple[str, list[int], bool]]:
        """The reply ended (its end id, or cut short): release what is held."""
        if self._at >= len(self._channels):
            return []
        name = self._channels[self._at][0]
        ids, self._held = self._held, []
        self._at = len(self._channels)
        return [(name, ids, True)]


def _find(ids: Sequence[int], pattern: Sequence[int]) -> int:
    """Index of the first occurrence of ``pattern`` in ``ids``, or -1."""
    n = len(pattern)
    if n == 0:
        return -1
    first = pattern[0]
    for i in range(len(ids) - n + 1):
        if ids[i] == first and list(ids[i:i + n]) == list(pattern):
            return i
    return -1


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
