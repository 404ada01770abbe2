"""One conversation on one session: each turn feeds only its own tokens.

A :class:`Conversation` keeps its transcript as the exact ids the model read and wrote (the
session's ids), never as re-encoded text, so a turn continues the carried KV and recurrent
state: it feeds the new user message, the generation prompt and the last reply's pending id,
nothing older. A reply cut short (``max_tokens``, or Ctrl-C between two tokens) is closed
with the format's closing ids at the start of the next turn, so the transcript stays well
formed.

Saving writes the session file (``k3core.run.state_file``: the ids, the state, the model's
fingerprint); everything else a conversation needs is read back from those ids: whether it
was opened with the same chat format, where the last reply starts, how many turns there
were (turn ``k`` samples with seed ``seed + k``, so a resumed conversation samples as an
uninterrupted one would).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3core.api.errors import UsageError
from k3core.serve.chat_format import ChatFormat, Message, Reply, XtmlFormat
from k3core.serve.loading import DEFAULT_CONTEXT
from k3core.serve.service import TextSink
from k3core.serve.tool_calls import ToolStream
from k3core.tokenizer.encoding import TokenLimitExceeded


@dataclass
class TurnResult:
    reply: Reply
    ids: list[int]  # the ids this turn generated
    prompt_fed: int  # prompt ids this turn fed: its own message (and the last reply's pending id)
    reused: int  # positions the carried state already held
    total: int  # ids in the conversation after the turn
    finish: str  # "stop", "length" or "cancelled"
    seconds: float


class Conversation:
    def __init__(self, session: Any, fmt: ChatFormat, system: str | None = None,
                 context: int = DEFAULT_CONTEXT):
        self.session = session
        self.fmt = fmt
        self.system = system
        self.context = context
        self.turns = 0
        self.reply_start: int | None = None  # index in session.ids where the last reply starts

    @property
    def ids(self) -> list[int]:
        return list(self.session.ids)

    def reset(self) -> None:
        self.session.reset()
        self.turns, self.reply_start = 0, None

    def opening(self, fmt: ChatFormat | None = None) -> list[int]:
        fmt = fmt or self.fmt
        ids = fmt.preamble()
        if self.system:
            ids += fmt.message(Message("system", self.system))
        return ids

    def turn_ids(self, text: str, limit: int | None = None) -> list[int]:
        """The ids a user message adds to the conversation (closing an unfinished reply first);
        past ``limit`` of them, :class:`TokenLimitExceeded` without tokenizing the rest."""
        fmt = self.fmt if limit is None else self.fmt.within(limit)
        ids = self.session.ids
        new: list[int] = self.opening(fmt) if not ids else []
        if self.reply_start is not None:
            new += self.fmt.close_reply(ids[self.reply_start:])
        fmt.checked(new)
        return fmt.checked(new + fmt.turn([Message("user", text)]))

    def say(self, text: str, max_tokens: int, sampling: dict[str, Any] | None = None,
            on_piece: Callable[[dict[str, str]], None] | None = None,
            cancel: threading.Event | None = None) -> TurnResult:
        """One turn: the user's text in, the reply out (streamed to ``on_piece``)."""
        import time

        t0 = time.perf_counter()
        before = len(self.session.ids)
        fits = max(self.context - before - 1, 0)  # what may be added, leaving one id to generate
        try:
            new = self.turn_ids(text, limit=fits)
        except TokenLimitExceeded as exc:
            raise UsageError(f"this message adds more than the {fits:,} tokens left in the context of "
                             f"{self.context} (the conversation holds {before}; {exc.how}); send less, "
                             "or /reset to start over") from None
        room = self.context - before - len(new)
        if room < 1:
            raise UsageError(f"the conversation holds {before} tokens and this message adds {len(new)}: "
                             f"no room left in the context of {self.context}; /reset to start over")
        n = min(max_tokens, room)
        params: dict[str, Any] = {"max_tokens": n, "stop_ids": list(self.fmt.stop_ids)}
        if sampling:
            params.update(sampling)
            if sampling.get("seed") is not None:
                params["seed"] = int(sampling["seed"]) + self.turns
        reused = self.session.positions
        prompt_fed = len(self.session.pending) + len(new)
        # the calls a reply writes in its tools channel, as calls (k3 chat prints them)
        tools = ToolStream(self.fmt, None) if isinstance(self.fmt, XtmlFormat) else None
        sink = TextSink(self.fmt.tok, [], self.fmt, tools=tools)
        sink.on_piece = on_piece
        finish = "length"
        start = before + len(new)
        steps = self.session.steps(new, _params(params))
        try:
            for step, piece in steps:
                sink.on_step(step, piece)
                if step is not None and (self.fmt.is_stop(step.token) or step.token in self.session.engine.eos_ids):
                    finish = "stop"
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
        finally:
            steps.close()
        sink.finish()
        gen_ids = list(self.session.ids[start:])
        self.turns += 1
        self.reply_start = start
        return TurnResult(self.fmt.parse_reply(gen_ids), gen_ids, prompt_fed, reused, len(self.session.ids), finish,
                          time.perf_counter() - t0)

    # ---- saving and loading ---------------------------------------------------------------
    def save(self, path: Path) -> int:
        if not self.session.ids:
            raise UsageError("nothing to save yet: the conversation is empty")
        return int(self.session.save(path))

    def load(self, path: Path) -> None:
        """Replace this conversation with the one saved at ``path`` (same model and format)."""
        old_ids, old_state = self.session.ids, self.session.state
        self.session.load(path)
        ids = list(self.session.ids)
        prompt = self.fmt.generation_prompt()
        starts = [i + len(prompt) for i in range(len(ids) - len(prompt) + 1) if ids[i:i + len(prompt)] == prompt]
        opening = self.fmt.preamble()
        if not starts or ids[:len(opening)] != opening:
            self.session.ids, self.session.state = old_ids, old_state
            raise UsageError(f"{path} is not a conversation in this chat format ({self.fmt.name}"
                             f"{'' if getattr(self.fmt, 'thinking', True) else ', no thinking'})")
        self.turns = len(starts)
        self.reply_start = starts[-1]


def _params(kw: dict[str, Any]) -> Any:
    from k3core.run.request import GenerationParams, build

    return build(GenerationParams, {k: v for k, v in kw.items() if v is not None})
