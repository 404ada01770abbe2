"""Hostile tokenizer files are refused cleanly; any bytes and ids survive encode/decode.

Each reader gets at least 10,000 seeded cases in the default run (small inputs, so it stays
fast); the ``slow`` variants run ten times as many with bigger inputs.
"""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tok_support import fitted_tokenizer, reference_encoding

from k3core.api.errors import TokenizerError, UsageError
from k3core.tokenizer.encoding import Tokenizer
from k3core.tokenizer.files import AddedToken, parse_tiktoken_model, parse_tokenizer_config

SRC = "fuzz/tiktoken.model"
CFG = "fuzz/tokenizer_config.json"


def _settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---- tiktoken.model -----------------------------------------------------------------------


class Tape:
    """Reads a fuzz case's choices off one drawn byte string (cheap to draw, still shrinks)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def pick(self, n: int) -> int:
        if n <= 1 or self.pos >= len(self.data):
            self.pos += 1
            return 0
        self.pos += 1
        return self.data[self.pos - 1] % n

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


BASE_TOKENS = [bytes([b]) for b in b"abcdefgh "] + [b"ab", b"abc", b" a", b"\xe4\xb8\xad"]
BASE_LINES = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(BASE_TOKENS)]
ODD_RANKS = ["-1", "+1", "1.0", "x", "", "٣", "99999999999", "00", "4294967296", " 1"]
ODD_LINES = ["", "\r", " ", "  0", "= 0", "YQ==", "YQ== 0 0", "!!!! 1", "YQ 1", "=YQ= 1"]


BIG_TOKENS = [bytes([b]) for b in range(256)] + [
    bytes([a, b]) for a in b"etaoin " for b in b"nrsd "
]
BIG_LINES = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(BIG_TOKENS)]


def model_file(tape: Tape, base: list[str] = BASE_LINES, max_ops: int = 4) -> bytes:
    if tape.pick(6) == 5:
        return tape.take(len(tape.data))
    lines = base[: len(base) - tape.pick(len(base) + 1)]
    for i in range(len(lines) - 1, 0, -1):  # shuffle
        j = tape.pick(i + 1)
        lines[i], lines[j] = lines[j], lines[i]
    for _ in range(tape.pick(max_ops)):
        op, i = tape.pick(9), tape.pick(max(len(lines), 1))
        if op == 8 and lines:
            del lines[i]
        elif op == 1 and lines:
            dup = lines[tape.pick(len(lines))]
            if tape.pick(2):  # same bytes under the next free rank
                dup = f"{dup.split(' ')[0]} {len(lines)}"
            lines.insert(i, dup)
        elif op == 2 and lines:
            rank = ODD_RANKS[tape.pick(len(ODD_RANKS))] if tape.pick(2) else str(tape.pick(40))
            lines[i] = f"{lines[i].split(' ')[0]} {rank}"
        elif op == 3 and lines:
            b64 = base64.b64encode(tape.take(tape.pick(5))).decode()
            lines[i] = f"{b64[: len(b64) - tape.pick(3)]} {lines[i].split(' ')[-1]}"
        elif op == 4 and len(lines) > 1:
            j = tape.pick(len(lines))
            ti, _, ri = lines[i].rpartition(" ")
            tj, _, rj = lines[j].rpartition(" ")
            lines[i], lines[j] = f"{ti} {rj}", f"{tj} {ri}"
        elif op == 5:
            b64 = base64.b64encode(tape.take(1 + tape.pick(4))).decode()
            lines.append(f"{b64} {len(lines) + tape.pick(5) - 2}")
        elif op == 6 and lines:
            k = tape.pick(len(lines[i]) + 1)
            junk = tape.take(tape.pick(4)).decode("utf-8", "surrogateescape")
            lines[i] = lines[i][:k] + junk + lines[i][k:]
        elif op == 7 and len(lines) > 1:
            lines[i : i + 2] = [" ".join(lines[i : i + 2])]
        elif op == 0:
            lines.insert(i, ODD_LINES[tape.pick(len(ODD_LINES))])
    end = ["\n", "", "\r\n", "\n\n"][tape.pick(4)]
    data = (end or "\n").join(lines).encode("utf-8", "surrogateescape") + end.encode()
    if tape.pick(4) == 3:
        k = tape.pick(len(data) + 1)
        data = data[:k] + tape.take(tape.pick(4)) + data[k + tape.pick(3) :]
    return data


def _check_model(data: bytes) -> None:
    try:
        ranks = parse_tiktoken_model(data, SRC)
    except TokenizerError as e:
        assert str(e).startswith(SRC) and "\n" not in str(e)
        return
    assert sorted(ranks.values()) == list(range(len(ranks))) and ranks
    assert all(isinstance(t, bytes) and t for t in ranks)


@_settings(10_000)
@given(st.binary(max_size=48))
def test_tiktoken_model_reader_never_crashes(tape):
    _check_model(model_file(Tape(tape)))


@pytest.mark.slow
@_settings(100_000)
@given(st.binary(max_size=4000))
def test_tiktoken_model_reader_never_crashes_long(tape):
    _check_model(model_file(Tape(tape), BIG_LINES, max_ops=24))


# ---- tokenizer_config.json ----------------------------------------------------------------

ODD = [None, True, False, 0, -1, 1.5, "", "x", "[BOS]", [], [1, "a"], {}, {"a": 1}]
CONTENTS = ["[BOS]", "[EOS]", "<|open|>", "a", "中", " ", "", "\ud800", 5, None, [], {}]
SPECIAL = [True, False, None, "yes", 1, 0]
BAD_KEYS = ["01", "1e3", " 2", "2 ", "+3", "256.0", "", "٣", "0x10", "-1", "99999999999", "bos"]


def config_doc(tape: Tape, max_entries: int = 5) -> object:
    shape = tape.pick(10)
    if shape == 9:
        return ODD[tape.pick(len(ODD))]
    if shape == 8:
        return {"added_tokens_decoder": ODD[tape.pick(len(ODD))]}
    table: dict[str, object] = {}
    for _ in range(tape.pick(max_entries)):
        kind = tape.pick(8)
        key = BAD_KEYS[tape.pick(len(BAD_KEYS))] if kind == 7 else str(tape.pick(256) + 200)
        if kind == 6:
            entry: object = ODD[tape.pick(len(ODD))]
        else:
            if kind == 5:
                content: object = tape.take(tape.pick(6)).decode("utf-8", "replace")
            else:
                content = CONTENTS[tape.pick(len(CONTENTS))]
            entry = {"content": content}
            if tape.pick(2):
                entry["special"] = SPECIAL[tape.pick(len(SPECIAL))]
        table[key] = entry
    doc: dict[str, object] = {"added_tokens_decoder": table}
    if shape == 7:
        doc["eos_token"] = ODD[tape.pick(len(ODD))]
    return doc


def config_file(tape: Tape, max_entries: int = 5) -> bytes:
    if tape.pick(8) == 7:
        return tape.take(len(tape.data))
    data = json.dumps(config_doc(tape, max_entries), ensure_ascii=bool(tape.pick(2))).encode(
        "utf-8", "surrogatepass"
    )
    op = tape.pick(8)
    if op == 7:
        return data[: tape.pick(len(data) + 1)]
    if op == 6:
        k = tape.pick(len(data) + 1)
        return data[:k] + tape.take(1 + tape.pick(3)) + data[k:]
    if op == 5:
        return data.replace(b"}", b"},", 1)
    if op == 4:
        return data.replace(b'"content"', b'"content": 1, "content"', 1)
    return data


def _check_config(data: bytes) -> None:
    try:
        added = parse_tokenizer_config(data, CFG)
    except TokenizerError as e:
        assert str(e).startswith(CFG) and "\n" not in str(e)
        return
    contents = [t.content for t in added.values()]
    assert len(set(contents)) == len(contents)
    for tid, t in added.items():
        assert isinstance(t, AddedToken) and t.id == tid and 0 <= tid < 2**31
        assert isinstance(t.content, str) and t.content and isinstance(t.special, bool)
        t.content.encode("utf-8")


@_settings(10_000)
@given(st.binary(max_size=48))
def test_tokenizer_config_reader_never_crashes(tape):
    _check_config(config_file(Tape(tape)))


@pytest.mark.slow
@_settings(100_000)
@given(st.binary(max_size=4000))
def test_tokenizer_config_reader_never_crashes_long(tape):
    _check_config(config_file(Tape(tape), max_entries=40))


# ---- the two together ---------------------------------------------------------------------

BYTE_RANKS = {bytes([b]): b for b in range(256)}


@st.composite
def table_pairs(draw):
    extra = draw(st.lists(st.binary(min_size=2, max_size=4), max_size=6, unique=True))
    ranks = dict(BYTE_RANKS)
    for t in extra:
        ranks.setdefault(t, len(ranks))
    if draw(st.integers(0, 9)) == 0:
        ranks.pop(bytes([draw(st.integers(0, 255))]))
    ids = draw(st.lists(st.integers(200, 300), max_size=5, unique=True))
    names = draw(
        st.lists(st.text(min_size=1, max_size=5), min_size=len(ids), max_size=len(ids), unique=True)
    )
    added = {i: AddedToken(i, n, True) for i, n in zip(ids, names, strict=True)}
    vocab = draw(st.one_of(st.none(), st.integers(250, 320)))
    return ranks, added, vocab


@_settings(500)
@given(table_pairs(), st.lists(st.integers(-2, 330), max_size=8), st.text(max_size=12))
def test_tokenizer_build_and_use_never_crashes(tables, ids, text):
    ranks, added, vocab = tables
    try:
        tok = Tokenizer(ranks, added, vocab_size=vocab, source="fuzz")
    except TokenizerError as e:
        assert str(e).startswith("fuzz")
        return
    assert tok.decode_bytes(tok.encode_bytes(text.encode("utf-8", "surrogatepass"))) == text.encode(
        "utf-8", "surrogatepass"
    )
    try:
        out = tok.decode(ids)
    except UsageError:
        assert any(not 0 <= i < tok.vocab_size for i in ids)
        return
    dec = tok.incremental_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == out


# ---- encode/decode on the fitted real-layout tokenizer ------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return fitted_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference_encoding(tmp_path_factory)


SPECIAL_BITS = ["[BOS]", "[EOS]", "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>", "[PAD]"]
texts = st.lists(
    st.one_of(
        st.text(max_size=12),
        st.sampled_from(SPECIAL_BITS),
        st.sampled_from(["中文", "'s", " \n", "👨\u200d👩"]),
    ),
    max_size=6,
).map("".join)


@_settings(800)
@given(data=st.data())
def test_random_text_parity_and_bytes_round_trip(tok, ref, data):
    text = data.draw(texts.filter(lambda s: not any("\ud800" <= c <= "\udfff" for c in s)))
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all")
    assert tok.decode(ids) == text
    raw = data.draw(st.binary(max_size=64))
    assert tok.decode_bytes(tok.encode_bytes(raw)) == raw
