"""A conversation in process: each turn feeds only its own tokens, and what it generates is
what one fresh run over the whole transcript generates."""

from __future__ import annotations

import threading

from k3core.serve.chat_format import chat_format_for
from k3core.serve.conversation import Conversation


def test_turns_carry_state_and_match_a_fresh_run(engine, tmp_path):
    fmt = chat_format_for(engine.tokenizer)
    conv = Conversation(engine.session(), fmt, system="Be brief.", context=2048)
    pieces: list[dict[str, str]] = []
    first = conv.say("Hello", 5, on_piece=pieces.append)
    assert first.reused == 0 and first.prompt_fed == len(conv.ids) - len(first.ids)
    assert "".join(p.get("reasoning", "") for p in pieces) == (first.reply.reasoning or "")
    second = conv.say("And then?", 5)
    assert second.reused == first.total - 1  # everything but the pending id of reply one
    before = list(conv.ids)
    third = conv.say("A third thing", 6, sampling={"temperature": 0.7, "seed": 5})
    prompt = conv.ids[: len(conv.ids) - len(third.ids)]
    assert prompt[: len(before)] == before  # the turn appended its own ids only
    fresh = engine.generate(prompt, max_tokens=6, stop_ids=list(fmt.stop_ids), temperature=0.7,
                            seed=5 + 2)  # turn k samples with seed + k
    assert third.ids == fresh.ids
    path = tmp_path / "c.k3s"
    conv.save(path)
    other = Conversation(engine.session(), fmt, system="Be brief.", context=2048)
    other.load(path)
    assert other.ids == conv.ids and other.turns == 3


def test_a_cancelled_reply_is_closed_by_the_next_turn(engine):
    fmt = chat_format_for(engine.tokenizer)
    conv = Conversation(engine.session(), fmt, context=2048)
    stop = threading.Event()
    seen: list[dict[str, str]] = []

    def on_piece(p: dict[str, str]) -> None:
        seen.append(p)
        stop.set()

    cut = conv.say("Hi", 100, on_piece=on_piece, cancel=stop)
    assert cut.finish == "cancelled" and len(cut.ids) < 100
    nxt = conv.turn_ids("More")
    closing = fmt.close_reply(cut.ids)
    assert closing and nxt[: len(closing)] == closing
    res = conv.say("More", 3)
    assert res.prompt_fed == 1 + len(nxt)  # the pending id, the closure, the new message
