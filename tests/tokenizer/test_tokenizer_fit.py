"""The fitted tokenizer writer: layout, exact rank counts, determinism, atomic writes, speed."""

from __future__ import annotations

import base64
import os
import time

import pytest
import tiktoken
from tok_support import SPEC_PAT_STR, fitted_dir, fitted_tokenizer

from k3core.api.errors import Exit, OutputError, UsageError
from k3core.tokenizer.bpe_train import split_pieces, train_bpe
from k3core.tokenizer.encoding import KIMI_PAT_STR, Tokenizer
from k3core.tokenizer.fit import (
    default_corpus,
    special_block_size,
    special_layout,
    write_tokenizer,
)

# docs/model.md §7, the released table
RELEASED = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|end_of_msg|>",
    163587: "<|open|>",
    163588: "<|close|>",
    163589: "<|sep|>",
    163590: "[start_header_id]",
    163591: "[end_header_id]",
    163593: "[EOT]",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163649: "<osagent_mode>",
    163838: "[UNK]",
    163839: "[PAD]",
}


def _ranks(d) -> list[bytes]:
    out = []
    for i, line in enumerate((d / "tiktoken.model").read_bytes().splitlines()):
        tok, rank = line.split(b" ")
        assert int(rank) == i
        out.append(base64.b64decode(tok))
    return out


def test_pattern_is_the_spec_pattern():
    assert KIMI_PAT_STR == SPEC_PAT_STR


def test_real_vocab_reproduces_the_released_layout(tmp_path_factory):
    assert special_layout(163_840) == RELEASED
    tok = fitted_tokenizer(tmp_path_factory)
    assert {i: t.content for i, t in tok.added_tokens.items()} == RELEASED
    assert tok.n_ranks == 163_584 and tok.vocab_size == 163_840


@pytest.mark.parametrize(
    "vocab,block,named",
    [
        (256, 0, 0),
        (257, 1, 1),
        (258, 2, 2),
        (259, 3, 3),
        (300, 44, 15),
        (511, 255, 16),
        (512, 256, 16),
        (4096, 256, 16),
    ],
)
def test_layout_scales(vocab, block, named):
    assert special_block_size(vocab) == block
    lay = special_layout(vocab)
    assert len(lay) == named
    assert all(vocab - block <= i < vocab for i in lay)
    if block >= 2:
        assert lay[vocab - 2] == "[UNK]" and lay[vocab - 1] == "[PAD]"
    if vocab >= 512:
        shifted = {i - 163_840 + vocab: n for i, n in RELEASED.items()}
        assert lay == shifted


def test_layout_300_example_from_the_docstring():
    lay = special_layout(300)
    assert lay[256] == "[BOS]" and lay[277] == "<|media_pad|>"
    assert lay[298] == "[UNK]" and lay[299] == "[PAD]"
    assert "<osagent_mode>" not in lay.values()


@pytest.mark.parametrize("vocab", [256, 300, 512, 1000, 4096, 32_768])
def test_exact_rank_count_and_loadable(tmp_path, vocab):
    lay = write_tokenizer(tmp_path, vocab)
    ranks = _ranks(tmp_path)
    assert len(ranks) == lay.n_ranks == vocab - special_block_size(vocab)
    assert ranks[:256] == [bytes([b]) for b in range(256)]
    assert len(set(ranks)) == len(ranks)
    assert lay.corpus_merges + lay.filled == lay.n_ranks - 256
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == vocab
    data = default_corpus()[:3000]
    ids = tok.encode_bytes(data)
    assert all(0 <= i < vocab for i in ids)
    assert tok.decode_bytes(ids) == data


def test_every_rank_is_two_earlier_ranks(tmp_path_factory):
    ranks = _ranks(fitted_dir(tmp_path_factory, 32_768))
    rank_of = {t: i for i, t in enumerate(ranks)}
    for r in range(256, len(ranks)):
        t = ranks[r]
        assert any(
            rank_of.get(t[:k], r) < r and rank_of.get(t[k:], r) < r for k in range(1, len(t))
        ), (r, t)


def test_corpus_merges_compress(tmp_path_factory):
    tok = fitted_tokenizer(tmp_path_factory, 4096)
    data = default_corpus()
    assert len(tok.encode_bytes(data)) < len(data) / 2.5


def test_deterministic_and_seed_only_moves_the_fill(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    la = write_tokenizer(a, 10_000, seed=0)
    write_tokenizer(b, 10_000, seed=0)
    lc = write_tokenizer(c, 10_000, seed=1)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    ra, rc = _ranks(a), _ranks(c)
    k = 256 + la.corpus_merges
    assert la.filled > 0 and lc.corpus_merges == la.corpus_merges
    assert ra[:k] == rc[:k] and ra[k:] != rc[k:]


def test_custom_corpus_including_invalid_utf8(tmp_path):
    corpus = ("abcabcabd " * 50).encode() + b"\xff\xfe\xff\xfe \xc3( " * 20
    lay = write_tokenizer(tmp_path, 1024, corpus=corpus)
    ranks = _ranks(tmp_path)
    assert b" abcabcabd" in ranks and b" \xff\xfe\xff\xfe" in ranks
    assert lay.corpus_merges > 0 and lay.filled > 0
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.decode_bytes(tok.encode_bytes(corpus)) == corpus


def test_trainer_stops_when_asked():
    assert len(train_bpe(default_corpus(), 10)) == 10
    assert train_bpe(b"", 10) == []
    assert train_bpe(b"aaaa", 5) == [b"aa", b"aaaa"]


def test_piece_splitter_agrees_with_tiktoken():
    """Every piece made a rank: tiktoken then emits exactly the splitter's pieces."""
    texts = [default_corpus()] + [
        s.encode()
        for s in (
            "ſ 'ſ 'S ß 'ß ǅemal ʼ e\u0301 \u0301x",
            "a\u00a0b\u2003c\u3000d\u2028e\u0085f\u200bg\x1ch\x0bi\x0cj",
            "中文abc中文DEF中文123   \n\n  \r\n\t x  ",
            "👨\u200d👩\u200d👧 1️⃣ 🇯🇵 ١٢٣٤ ①②③ ½ ²³",
        )
    ]
    for data in texts:
        pieces = split_pieces(data)
        assert b"".join(pieces) == data
        ranks = {bytes([b]): b for b in range(256)}
        for p in pieces:
            ranks.setdefault(p, len(ranks))
        enc = tiktoken.Encoding(
            "split-check", pat_str=SPEC_PAT_STR, mergeable_ranks=ranks, special_tokens={}
        )
        got = [enc.decode_single_token_bytes(t) for t in enc.encode_ordinary(data.decode())]
        assert got == pieces


def test_config_file_shape(tmp_path):
    import json

    write_tokenizer(tmp_path, 4096)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "TikTokenTokenizer"
    assert cfg["bos_token"] == "[BOS]" and cfg["eos_token"] == "[EOS]"
    assert cfg["added_tokens_decoder"]["3840"] == {
        "content": "[BOS]",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    write_tokenizer(tmp_path / "tiny", 256)
    tiny = json.loads((tmp_path / "tiny" / "tokenizer_config.json").read_text())
    assert tiny["added_tokens_decoder"] == {} and "bos_token" not in tiny


@pytest.mark.parametrize("bad", [255, 0, -5, "4096", 4096.0, True, None, (1 << 20) + 257])
def test_bad_vocab_refused(tmp_path, bad):
    with pytest.raises(UsageError) as e:
        write_tokenizer(tmp_path, bad)
    assert e.value.exit_code == Exit.USAGE
    assert not any(tmp_path.iterdir())


def test_bad_seed_and_corpus_refused(tmp_path):
    with pytest.raises(UsageError):
        write_tokenizer(tmp_path, 512, seed="1")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        write_tokenizer(tmp_path, 1024, corpus="text")  # type: ignore[arg-type]


def test_writes_are_atomic_and_replace(tmp_path):
    write_tokenizer(tmp_path, 4096)
    write_tokenizer(tmp_path, 512)  # replaces both files in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiktoken.model", "tokenizer_config.json"]
    assert Tokenizer.from_dir(tmp_path).vocab_size == 512


def test_unwritable_target_refused_without_debris(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputError) as e:
        write_tokenizer(f, 512)
    assert e.value.exit_code == Exit.OUTPUT
    d = tmp_path / "ro"
    d.mkdir()
    (d / "tiktoken.model").mkdir()  # a directory where the file must go: rename fails
    with pytest.raises(OutputError, match="tiktoken.model"):
        write_tokenizer(d, 512)
    assert sorted(p.name for p in d.iterdir()) == ["tiktoken.model"]
    if os.geteuid() != 0:
        ro = tmp_path / "readonly"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(OutputError):
                write_tokenizer(ro, 512)
            assert not any(ro.iterdir())
        finally:
            ro.chmod(0o700)


def test_fit_is_fast(tmp_path):
    t = time.process_time()
    write_tokenizer(tmp_path, 32_768)
    took = time.process_time() - t
    assert took < 5.0, f"fitting a 32k vocabulary took {took:.2f}s of CPU"
