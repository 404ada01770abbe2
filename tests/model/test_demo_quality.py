"""What the shipped demo model promises beyond exactness (demo-model/MODEL_CARD.md).

- greedy decoding of the README's demo prompt (``demo-model/prompt.txt``) does not fall into
  a loop within 64 tokens: no run of 8 ids comes back three times, and the last 32 ids are
  not one short cycle repeated;
- a chat question, framed as ``k3 chat`` and ``k3 serve`` frame it (XTML, no thinking, the
  demo model's default), gets a greedy reply that stays in its channel and ends with the
  end-of-message id.

Two of these do not hold yet and are marked so (strict: a model that passes them must say
so here and in its card): greedy decoding of the demo prompt still falls into a loop
(``'none', 'none', ...`` after a docstring), and a question about prose gets an answer that
never ends its turn. Both are open targets of the demo model (its card, "Known limits").
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from k3core.run.engine import open_engine
from k3core.run.request import EngineRequest
from k3core.serve.chat_format import Message, XtmlFormat
from k3core.tokenizer.encoding import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "demo-model"


@pytest.fixture(scope="module")
def engine():
    with open_engine(EngineRequest(model_dir=DEMO, backend="avx2", threads=2)) as eng:
        yield eng


def loops(ids: list[int], n: int = 8, times: int = 3, tail: int = 32, period: int = 12) -> bool:
    """A run of ``n`` ids seen ``times`` times, or the last ``tail`` ids one cycle of at most
    ``period`` ids repeated."""
    grams = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    if grams and max(grams.values()) >= times:
        return True
    end = ids[-tail:]
    return len(end) == tail and any(
        all(end[i] == end[i - p] for i in range(p, tail)) for p in range(1, period + 1))


def test_the_loop_detector() -> None:
    assert loops([1, 2, 3] * 20)
    assert loops(list(range(40)) + [7] * 32)
    assert not loops(list(range(64)))


@pytest.mark.xfail(strict=True, reason="the shipped demo model still loops greedily on the "
                   "demo prompt (demo-model/MODEL_CARD.md, Known limits)")
def test_greedy_demo_prompt_does_not_loop(engine) -> None:
    prompt = (DEMO / "prompt.txt").read_text(encoding="utf-8")
    gen = engine.generate(prompt, max_tokens=64, temperature=0.0, ignore_eos=True)
    assert len(gen.ids) == 64
    assert not loops(gen.ids), gen.text


@pytest.mark.parametrize("question", [
    "Write a Python function `add` that returns the sum of two numbers.",
    pytest.param("What is a context manager?", marks=pytest.mark.xfail(
        strict=True, reason="prose answers do not end their turn yet (demo-model/MODEL_CARD.md)")),
])
def test_chat_reply_stays_in_its_channel_and_ends(engine, question) -> None:
    tok = engine.tokenizer
    assert isinstance(tok, Tokenizer)
    fmt = XtmlFormat(tok, thinking=False)
    prompt = fmt.render([Message("user", question)])
    gen = engine.generate(prompt, max_tokens=400, temperature=0.0, stop_ids=list(fmt.stop_ids))
    reply = fmt.parse_reply(gen.ids)
    assert reply.finished and reply.well_formed, tok.decode(gen.ids)
    assert reply.content.strip()
