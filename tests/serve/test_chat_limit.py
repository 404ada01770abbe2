"""``k3 chat``: a message too long for what the context has left is refused (one ``k3: error:``
line) before it is tokenized in full, and the conversation goes on."""

from __future__ import annotations

import pytest
from conftest import k3_inprocess

from k3core.serve.chat_format import chat_format_for
from k3core.serve.conversation import Conversation
from k3core.tokenizer.encoding import TokenLimitExceeded


def test_a_huge_chat_line_is_refused_and_the_chat_goes_on(tiny_model):
    huge = "hello world " * 1_250_000  # 15 MB on one line
    r = k3_inprocess("chat", tiny_model, "--context", "256", "--max-tokens", "2", "--threads", "1",
                     input=huge + "\nhi\n")
    assert r.exit_code == 0, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("k3: error:")]
    assert len(errors) == 1 and "refused before tokenizing" in errors[0], r.stderr
    assert "Traceback" not in r.output
    assert "(2 tokens" in r.stderr  # the next turn ran


def test_counting_stops_within_a_turn(engine):
    fmt = chat_format_for(engine.tokenizer)
    conv = Conversation(engine.session(), fmt, context=512)
    with pytest.raises(TokenLimitExceeded) as e:
        conv.turn_ids("hello world\n" * 250, limit=511)  # 3,000 bytes: within the length bound
    assert "tokenizing stopped" in e.value.how
    assert conv.say("hi", 1).total > 0  # nothing was spent on the refused message
