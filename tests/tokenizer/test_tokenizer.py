"""Tokenizer: parity with tiktoken, byte-exact round trips, streaming, reserved ids, refusals."""

from __future__ import annotations

import json
import random
import re

import pytest
from tok_support import REAL_VOCAB, fitted_dir, fitted_tokenizer, reference_encoding

from k3core.api.errors import Exit, TokenizerError, UsageError
from k3core.tokenizer.encoding import MAX_RUN_CHARS, Tokenizer, reserved_name
from k3core.tokenizer.fit import default_corpus

# ---- the parity cases ---------------------------------------------------------------------

CASES: list[str] = [
    "",
    "The capital of France is",
    "Hello, world!",
    "I'm sure you'll see they've done it; she'd know, we're told, it's theirs.",
    "DON'T SHOUT. It'S John'S book, isn'T it? THEY'LL go. 'll 'LL 'Ll",
    "ſ 'ſ 'S 'ß ß ẞ Kelvin \u212a",
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな、漢字が混ざった文です。",
    "한국어 문장입니다. 안녕하세요! 반갑습니다.",
    "Привет, мир! Ёжик в тумане. ПРИВЕТ мир",
    "Українська: пʼять, сім'я, Ґанок, їжак.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "مَرْحَبًا بِكُمْ ٠١٢٣٤٥٦٧٨٩ ١٤٤٥/٠٩/٢١",
    "שלום עולם, מה שלומך?",
    "नमस्ते दुनिया, यह एक परीक्षण है। १२३",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "family 👨\u200d👩\u200d👧\u200d👦 and 👩\u200d👩\u200d👦",
    "👍🏻👍🏿 🇯🇵🇺🇦 🏳️\u200d🌈 1️⃣ #️⃣ ❤️\u200d🔥 🐈\u200d⬛",
    "café naïve résumé Ångström coöperate façade œuvre",
    "e\u0301 a\u0300\u0301 n\u0303 \u0301lead combining",
    "Tiếng Việt: Người được những trường Nguyễn",
    "Größe Maßstab Fußgängerübergänge ÄÖÜ äöü",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12))\n",
    'int main(void) {\n\tprintf("%d\\n", a[i++]);\n\treturn 0;\n}\n',
    '{"id": 42, "name": "k3", "tags": ["a", "b"], "ok": true, "x": null, "f": -1.5e-3}',
    "a    b\t\t c\n\n\n d   \n  e  ",
    "line1\r\nline2\r\n\r\nline4\rline5",
    "     ",
    "\n\n\n",
    "trailing spaces   ",
    "   leading spaces",
    "1234567890 3.14159 1,000,000 12345678901234567890 ①②③ ½",
    "Hello世界Привет123مرحبا한국abc中文def",
    "<|open|>user<|sep|>What is 2+2?<|end_of_msg|><|open|>assistant<|sep|>4<|close|>[EOS]",
    "x[BOS]y[EOS]z[PAD][UNK]",
    "<|open| [BO S] [EOS <|media_pad|<|media_pad|>>",
    "[BOS][EOS]<|end_of_msg|><|open|><|close|><|sep|>[start_header_id][end_header_id][EOT]"
    "<|media_begin|><|media_content|><|media_end|><|media_pad|><osagent_mode>[UNK][PAD]",
    "see https://example.org/a/b?c=d&e=f#g or mail user@example.com",
    "!!!??? ... --- *** ~~~ ((())) [[]] {{}} <<>> ///",
    "漢字かな交じり文とカタカナ語のミックス",
    "ＡＢＣ１２３ｱｲｳ　全角スペース",
    "a\u00a0b\u2003c\u3000d\u2028e\u0085f\u200bg\x1ch",
    "ǅemal ǈubljana ǋ titlecase",
    "modifier ʼ ˈ ˌ ʰ letters",
    "∀x∈ℝ: x²≥0, ∑ᵢ xᵢ = ∫₀^∞ e^(−t) dt",
    "| a | b |\n|---|--:|\n| 1 | 2 |\n",
    "中文abc中文DEF中文123中文",
    "[PAD]",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "\t\tindented\n    \n\ttabs and spaces mixed  \t \n",
    "tab\tafter\tword\t",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return fitted_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference_encoding(tmp_path_factory)


def test_enough_cases():
    assert len(CASES) >= 40 and len(set(CASES)) == len(CASES)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parity_with_tiktoken(tok, ref, case, tmp_path):
    text = CASES[case]
    want = ref.encode(text, allowed_special="all")
    assert tok.encode(text) == want
    # the same case through a file, as a prompt file arrives
    f = tmp_path / "prompt.txt"
    f.write_bytes(text.encode("utf-8"))
    data = f.read_bytes()
    assert tok.encode_bytes(data) == want
    assert tok.decode_bytes(want) == data
    assert tok.decode(want) == text


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parity_ordinary(tok, ref, case):
    text = CASES[case]
    assert tok.encode(text, allow_special=False) == ref.encode_ordinary(text)
    assert tok.encode_bytes(text.encode(), allow_special=False) == ref.encode_ordinary(text)


def test_specials_become_ids(tok):
    ids = tok.encode("a<|open|>b[EOS]")
    assert 163587 in ids and 163585 in ids
    assert 163587 not in tok.encode("a<|open|>b[EOS]", allow_special=False)
    assert tok.encode("[BOS]") == [163584]
    assert tok.special_token_id("<|end_of_msg|>") == 163586


def test_longest_added_token_wins(tmp_path_factory):
    base = fitted_tokenizer(tmp_path_factory, 512)
    ranks = {base.id_to_token_bytes(i): i for i in range(base.n_ranks)}
    added = {t.id: t for t in base.added_tokens.values()}
    from k3core.tokenizer.files import AddedToken

    added[300] = AddedToken(300, "<|open|>x", True)
    t = Tokenizer(ranks, added, vocab_size=512)
    assert t.encode("<|open|>x<|open|>y") == [300, t.special_token_id("<|open|>"), ord("y")]


def test_no_bos_added(tok):
    ids = tok.encode("The capital of France is")
    assert 163584 not in ids and 163585 not in ids and 163586 not in ids


# ---- byte-exact round trips ---------------------------------------------------------------

SCRIPTS = {
    "latin": r"[A-Za-z]",
    "han": r"[\u4e00-\u9fff]",
    "kana": r"[\u3040-\u30ff]",
    "hangul": r"[\uac00-\ud7af]",
    "cyrillic": r"[\u0400-\u04ff]",
    "arabic": r"[\u0600-\u06ff]",
}


def _script_text(script: str, size: int, seed: int) -> str:
    lines = default_corpus().decode("utf-8").splitlines(keepends=True)
    mine = [ln for ln in lines if re.search(SCRIPTS[script], ln)]
    rng = random.Random(seed)
    out: list[str] = []
    while sum(map(len, out)) < size:
        out.append(rng.choice(mine))
    return "".join(out)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_multi_kilobyte_files_round_trip(tok, ref, script, tmp_path):
    text = _script_text(script, 6000, seed=len(script))
    f = tmp_path / f"{script}.txt"
    f.write_bytes(text.encode("utf-8"))
    data = f.read_bytes()
    assert len(data) > 6000
    ids = tok.encode_bytes(data)
    assert ids == ref.encode(text, allowed_special="all")
    assert tok.decode_bytes(ids) == data
    assert len(ids) < len(data)


def test_whole_corpus_round_trips(tok):
    data = default_corpus()
    assert tok.decode_bytes(tok.encode_bytes(data)) == data


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_round_trip(tok, seed, tmp_path):
    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(4096))
    f = tmp_path / "noise.bin"
    f.write_bytes(data)
    ids = tok.encode_bytes(f.read_bytes())
    assert tok.decode_bytes(ids) == data
    assert all(0 <= i < tok.n_ranks for i in ids)


def test_invalid_utf8_between_valid_runs(tok):
    data = b"caf\xc3\xa9 \xff\xfe[EOS]\xed\xa0\x80 \xe4\xb8 ok \xf0\x9f\x98"
    ids = tok.encode_bytes(data)
    assert tok.decode_bytes(ids) == data
    assert 163585 in ids  # the valid run still sees its named token
    assert tok.decode(ids) == data.decode("utf-8", "replace")


def test_valid_utf8_bytes_encode_like_text(tok):
    for text in CASES:
        assert tok.encode_bytes(text.encode("utf-8")) == tok.encode(text)


def test_long_runs_are_chunked_not_crashed(tok):
    text = " " * (MAX_RUN_CHARS * 3 + 7) + "x" + "y" * (MAX_RUN_CHARS + 5)
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_lone_surrogates_in_text_become_replacement(tok):
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


# ---- streaming decode ---------------------------------------------------------------------


@pytest.mark.parametrize("case", range(len(CASES)))
def test_incremental_decoder_never_splits(tok, case):
    text = CASES[case]
    ids = tok.encode(text)
    dec = tok.incremental_decoder()
    out = ""
    for i in ids:
        piece = dec.push(i)
        assert "\ufffd" not in piece
        out += piece
        assert text.startswith(out)
    out += dec.flush()
    assert out == text


def test_incremental_decoder_holds_partial_characters(tok):
    dec = tok.incremental_decoder()
    emoji = "😀".encode()
    assert dec.push([emoji[0]]) == ""  # single-byte ranks are the byte values here
    assert dec.pending == emoji[:1]
    assert dec.push([emoji[1], emoji[2]]) == ""
    assert dec.push(emoji[3]) == "😀"
    assert dec.pending == b""
    assert dec.push([0xE4]) == ""
    assert dec.flush() == "\ufffd"


def test_incremental_decoder_matches_decode_on_random_ids(tok):
    rng = random.Random(5)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids += [rng.randrange(256) for _ in range(rng.randrange(10))]
        rng.shuffle(ids)
        dec = tok.incremental_decoder()
        pos, out = 0, ""
        while pos < len(ids):
            step = rng.randrange(1, 4)
            out += dec.push(ids[pos : pos + step])
            pos += step
        assert out + dec.flush() == tok.decode(ids)


def test_incremental_decoder_refuses_bad_ids_without_losing_state(tok):
    dec = tok.incremental_decoder()
    assert dec.push([0xF0]) == ""
    with pytest.raises(UsageError):
        dec.push([0x9F, REAL_VOCAB])
    assert dec.pending == b"\xf0"


# ---- ids, reserved names, facts -----------------------------------------------------------


def test_vocab_and_special_facts(tok):
    assert tok.vocab_size == REAL_VOCAB
    assert tok.n_ranks == 163_584
    assert len(tok.special_ids) == 16
    assert min(tok.special_ids) == 163_584 and max(tok.special_ids) == 163_839
    assert tok.special_tokens["[PAD]"] == 163_839
    assert all(t.special for t in tok.added_tokens.values())
    assert tok.id_to_token_bytes(163_593) == b"[EOT]"
    assert tok.id_to_token_bytes(ord("A")) == b"A"


def test_reserved_ids_decode_to_reserved_names(tok):
    for i in (163_592, 163_594, 163_601, 163_606, 163_648, 163_650, 163_837):
        assert tok.is_reserved(i)
        assert tok.decode([i]) == f"<|reserved_token_{i}|>" == reserved_name(i)
    assert not tok.is_reserved(163_593) and not tok.is_reserved(5)
    assert tok.decode([163_584, 163_608, 163_585]) == "[BOS]<|reserved_token_163608|>[EOS]"
    # reserved names are what ids decode to, not tokens one can type
    assert 163_608 not in tok.encode("<|reserved_token_163608|>")


@pytest.mark.parametrize("bad", [REAL_VOCAB, REAL_VOCAB + 1, -1, 2**40, "5", 1.0, True, None])
def test_ids_outside_the_vocab_refused(tok, bad):
    with pytest.raises(UsageError) as e:
        tok.decode_bytes([1, bad])
    assert e.value.exit_code == Exit.USAGE
    with pytest.raises(UsageError):
        tok.decode([bad])
    with pytest.raises(UsageError):
        tok.id_to_token_bytes(bad)


def test_numpy_ids_accepted(tok):
    np = pytest.importorskip("numpy")
    ids = np.array(tok.encode("hello 中文"), dtype=np.int32)
    assert tok.decode(ids) == "hello 中文"


def test_encode_type_errors(tok):
    with pytest.raises(UsageError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        tok.encode_bytes("text")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        tok.special_token_id("[NOPE]")


def test_model_vocab_override(tmp_path_factory):
    d = fitted_dir(tmp_path_factory)
    t = Tokenizer.from_dir(d, vocab_size=REAL_VOCAB + 64)
    assert t.vocab_size == REAL_VOCAB + 64
    assert t.decode([REAL_VOCAB + 3]) == reserved_name(REAL_VOCAB + 3)
    with pytest.raises(TokenizerError, match="too small"):
        Tokenizer.from_dir(d, vocab_size=REAL_VOCAB - 1)


def test_tiny_byte_level_tokenizer(tmp_path_factory):
    t = fitted_tokenizer(tmp_path_factory, 256)
    assert t.vocab_size == 256 and t.n_ranks == 256 and not t.special_ids
    assert t.encode("[EOS] hi") == list(b"[EOS] hi")
    with pytest.raises(UsageError):
        t.decode([256])


# ---- refusals -----------------------------------------------------------------------------


def _byte_lines(extra: list[str] | None = None) -> list[str]:
    import base64

    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    return lines + (extra or [])


def _write(d, model_lines=None, config=None, model_bytes=None, config_bytes=None):
    d.mkdir(parents=True, exist_ok=True)
    if model_bytes is None:
        model_bytes = (
            "\n".join(_byte_lines() if model_lines is None else model_lines) + "\n"
        ).encode()
    if config_bytes is None:
        doc = {"added_tokens_decoder": {"256": {"content": "[BOS]", "special": True}}}
        config_bytes = json.dumps(doc if config is None else config).encode()
    (d / "tiktoken.model").write_bytes(model_bytes)
    (d / "tokenizer_config.json").write_bytes(config_bytes)
    return d


def _refused(d, *needles, **kw):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.from_dir(d, **kw)
    msg = str(e.value)
    assert e.value.exit_code == Exit.USAGE
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_minimal_files_load(tmp_path):
    t = Tokenizer.from_dir(_write(tmp_path))
    assert t.vocab_size == 257 and t.encode("[BOS]a") == [256, 97]


MODEL_BAD = {
    "bad base64": (["!!!! 256"], "line 257", "base64"),
    "bad padding": (["YWI 256"], "line 257", "base64"),
    "no rank": (["YWI="], "line 257", "no rank"),
    "three fields": (["YWI= 256 7"], "line 257", "two fields"),
    "tab separated": (["YWI=\t256"], "line 257", "no rank"),
    "negative rank": (["YWI= -1"], "line 257", "not an integer"),
    "signed rank": (["YWI= +256"], "line 257", "not an integer"),
    "float rank": (["YWI= 256.0"], "line 257", "not an integer"),
    "arabic-indic digits": (["YWI= ٢٥٦"], "line 257", "not an integer"),
    "huge rank": (["YWI= 99999999999"], "line 257", "not an integer"),
    "empty token": ([" 256"], "line 257", "empty token"),
    "duplicate rank": (["YWI= 255"], "line 257", "rank 255 already given on line 256"),
    "duplicate bytes": (["YQ== 256"], "line 257", "already given on line 98"),
    "gap in ranks": (["YWI= 300"], "line 257", "rank 256 is missing"),
}


@pytest.mark.parametrize("name", sorted(MODEL_BAD))
def test_tiktoken_model_refusals(tmp_path, name):
    extra, *needles = MODEL_BAD[name]
    d = _write(tmp_path, model_lines=_byte_lines(extra))
    _refused(d, "tiktoken.model", *needles)


def test_missing_single_bytes_refused(tmp_path):
    import base64

    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(200)]
    _refused(
        _write(tmp_path, model_lines=lines, config={"added_tokens_decoder": {}}), "56 of the 256"
    )


def test_empty_model_refused(tmp_path):
    _refused(_write(tmp_path, model_bytes=b""), "tiktoken.model", "no ranks")


CONFIG_BAD = {
    "not utf-8": (b'{"added_tokens_decoder": {}, "x": "\xff"}', "line 1", "not UTF-8"),
    "invalid json": (b'{\n"added_tokens_decoder": {\n}\n,}', "line 4", "column"),
    "truncated": (b'{"added_tokens_decoder": {"256": {"content": "[BO', "line 1"),
    "nan": (b'{"added_tokens_decoder": {}, "x": NaN}', "NaN"),
    "duplicate key": (
        b'{"added_tokens_decoder": {"256": {"content": "a"}, "256": {"content": "b"}}}',
        "duplicate key '256'",
    ),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, "nested"),
    "top-level list": (b"[]", "top level is a list"),
    "no table": (b"{}", "no 'added_tokens_decoder'"),
    "table is a list": (b'{"added_tokens_decoder": []}', "'added_tokens_decoder' is a list"),
    "word key": (b'{"added_tokens_decoder": {"bos": {"content": "a"}}}', "'bos'", "not a token id"),
    "negative key": (
        b'{"added_tokens_decoder": {"-1": {"content": "a"}}}',
        "'-1'",
        "not a token id",
    ),
    "leading zero key": (b'{"added_tokens_decoder": {"0256": {"content": "a"}}}', "not a token id"),
    "float key": (b'{"added_tokens_decoder": {"256.0": {"content": "a"}}}', "not a token id"),
    "spaced key": (b'{"added_tokens_decoder": {" 256": {"content": "a"}}}', "not a token id"),
    "huge key": (b'{"added_tokens_decoder": {"99999999999": {"content": "a"}}}', "not a token id"),
    "entry a string": (
        b'{"added_tokens_decoder": {"256": "[BOS]"}}',
        "['256']",
        "expected an object",
    ),
    "content a number": (
        b'{"added_tokens_decoder": {"256": {"content": 5}}}',
        "content",
        "expected a string",
    ),
    "content missing": (
        b'{"added_tokens_decoder": {"256": {"special": true}}}',
        "content",
        "missing",
    ),
    "content empty": (b'{"added_tokens_decoder": {"256": {"content": ""}}}', "content", "empty"),
    "lone surrogate": (b'{"added_tokens_decoder": {"256": {"content": "\\ud800"}}}', "surrogate"),
    "special a string": (
        b'{"added_tokens_decoder": {"256": {"content": "a", "special": "yes"}}}',
        "special",
        "true or false",
    ),
    "same content twice": (
        b'{"added_tokens_decoder": {"256": {"content": "a"}, "257": {"content": "a"}}}',
        "already bound to id 256",
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIG_BAD))
def test_tokenizer_config_refusals(tmp_path, name):
    data, *needles = CONFIG_BAD[name]
    _refused(_write(tmp_path, config_bytes=data), "tokenizer_config.json", *needles)


def test_added_id_colliding_with_a_rank_refused(tmp_path):
    cfg = {"added_tokens_decoder": {"97": {"content": "[BOS]", "special": True}}}
    _refused(_write(tmp_path, config=cfg), "tokenizer_config.json", "id 97", "is a BPE rank")


def test_oversized_files_refused_before_reading(tmp_path):
    from k3core.tokenizer.files import MAX_TIKTOKEN_MODEL_BYTES, MAX_TOKENIZER_CONFIG_BYTES

    d = _write(tmp_path / "a")
    with open(d / "tiktoken.model", "r+b") as f:
        f.truncate(MAX_TIKTOKEN_MODEL_BYTES + 1)  # sparse: nothing is really written
    _refused(d, "tiktoken.model", "limit")
    d = _write(tmp_path / "b")
    with open(d / "tokenizer_config.json", "r+b") as f:
        f.truncate(MAX_TOKENIZER_CONFIG_BYTES + 1)
    _refused(d, "tokenizer_config.json", "limit")


def test_missing_and_odd_paths_refused(tmp_path):
    _refused(tmp_path / "nowhere", "not a directory")
    d = _write(tmp_path / "m")
    (d / "tokenizer_config.json").unlink()
    _refused(d, "tokenizer_config.json", "no such file")
    d = _write(tmp_path / "n")
    (d / "tiktoken.model").unlink()
    (d / "tiktoken.model").mkdir()
    _refused(d, "tiktoken.model", "not a regular file")


def test_crlf_and_blank_lines_tolerated_like_tiktoken(tmp_path):
    lines = _byte_lines(["YWI= 256"])
    data = ("\r\n".join(lines[:100]) + "\r\n\r\n" + "\n".join(lines[100:]) + "\n").encode()
    t = Tokenizer.from_dir(_write(tmp_path, model_bytes=data, config={"added_tokens_decoder": {}}))
    assert t.encode("ab") == [256]


# ---- the split pattern itself, as tiktoken's engine runs it -------------------------------

SPLITS = {
    "中文abc中文DEF": ["中文", "abc", "中文", "DEF"],
    "Hello 中文": ["Hello", " ", "中文"],
    "日本語のテキスト": ["日本語", "のテキスト"],
    "don't DON'T they're": ["don't", " DON'T", " they're"],
    "123456 7": ["123", "456", " ", "7"],
    "a/b": ["a", "/b"],
    "x  \n\n  y": ["x", "  \n\n", " ", " y"],
    "HelloWorld": ["Hello", "World"],
}


@pytest.mark.parametrize("text", sorted(SPLITS))
def test_kimi_pattern_splits_as_specified(text):
    """With every expected piece made a rank, tiktoken must emit exactly those pieces."""
    import tiktoken

    from k3core.tokenizer.encoding import KIMI_PAT_STR

    ranks = {bytes([b]): b for b in range(256)}
    for p in SPLITS[text]:
        ranks.setdefault(p.encode(), len(ranks))
    enc = tiktoken.Encoding("split", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    got = [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(text)]
    assert got == SPLITS[text]
