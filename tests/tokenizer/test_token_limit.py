"""A limited encode: refused by length before tokenizing, counting stops at the limit, and
within the limit exactly the ids of an unlimited encode."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.tokenizer.encoding import (
    PIECE_CHARS,
    TokenBudget,
    Tokenizer,
    TokenLimitExceeded,
    _pieces,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


class Counting(Tokenizer):
    """The real tokenizer, counting what it hands to tiktoken."""

    calls = 0
    chars = 0

    def _ordinary(self, text: str) -> list[int]:
        self.calls += 1
        self.chars += len(text)
        return super()._ordinary(text)


@pytest.fixture(scope="module")
def tok() -> Counting:
    return Counting.from_dir(ROOT / "demo-model")  # type: ignore[return-value]


def test_the_longest_token(tok):
    ranks = max(len(tok.id_to_token_bytes(i)) for i in range(tok.n_ranks))
    named = max(len(tok.id_to_token_bytes(i)) for i in tok.special_ids)
    assert tok.max_token_bytes(allow_special=False) == ranks
    assert tok.max_token_bytes() == max(ranks, named)


@pytest.mark.parametrize("size", [3, 17, 64, 500, PIECE_CHARS])
def test_pieces_give_the_ids_of_the_whole(tok, size):
    pieces = list(_pieces(DOCS, size))
    assert "".join(pieces) == DOCS
    if size < 1000:
        assert len(pieces) > len(DOCS) // (4 * size)  # it did cut
    ids = [i for p in pieces for i in tok._ordinary(p)]
    assert ids == tok._ordinary(DOCS)


TRICKY = st.lists(st.sampled_from(list("ab Z9\n\r\t .,!'s") + [
    "é", "中", "\u0301", "'S", "'ll", "\u00a0", "\x1c", "\u2028", "\u3000", "\n\n", "  "]),
    max_size=200).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=TRICKY, size=st.integers(2, 40))
def test_pieces_are_exact_on_any_text(tok, text, size):
    assert [i for p in _pieces(text, size) for i in tok._ordinary(p)] == tok._ordinary(text)


def test_within_the_limit_the_ids_are_exact(tok):
    text = DOCS[:200_000] + "<|im_end|>" + DOCS[:5000]
    full = tok.encode(text)
    assert tok.encode(text, limit=len(full)) == full
    assert tok.encode(text, allow_special=False, limit=10**9) == tok.encode(text, allow_special=False)
    raw = text.encode() + b"\xff\xfe caf\xe9" + text[:3000].encode()
    assert tok.encode_bytes(raw, limit=10**9) == tok.encode_bytes(raw)
    with pytest.raises(TokenLimitExceeded):
        tok.encode(text, limit=len(full) - 1)


def test_too_many_bytes_is_refused_before_tokenizing(tok):
    data = b"hello world " * 1_250_000  # 15 MB
    tok.calls = tok.chars = 0
    with pytest.raises(TokenLimitExceeded) as e:
        tok.encode_bytes(data, limit=1024)
    assert tok.calls == 0  # not one character reached tiktoken
    longest = tok.max_token_bytes()
    assert e.value.at_least == math.ceil(len(data) / longest) > 1024
    assert "refused before tokenizing" in str(e.value)
    with pytest.raises(TokenLimitExceeded):
        tok.encode(data.decode(), limit=1024)
    assert tok.calls == 0


def test_counting_stops_at_the_limit(tok):
    limit = 1000
    text = "hello world\n" * (limit * 3)  # within the length bound, over the limit
    assert math.ceil(len(text) / tok.max_token_bytes()) <= limit
    tok.calls = tok.chars = 0
    with pytest.raises(TokenLimitExceeded) as e:
        tok.encode(text, limit=limit)
    assert tok.chars < len(text) // 2  # it stopped long before the end
    assert limit < e.value.at_least <= limit + PIECE_CHARS
    assert "tokenizing stopped" in e.value.how


def test_a_budget_counts_across_calls(tok):
    budget = TokenBudget(10)
    a = tok.encode("hello", limit=budget)
    assert budget.used == len(a) and budget.left == 10 - len(a)
    with pytest.raises(TokenLimitExceeded) as e:
        tok.encode("hello world " * 10, limit=budget)
    assert e.value.limit == 10
