"""A ``tiktoken.model`` whose ranks do not run from 0 up to the special-token block is
refused: cut short at a line boundary (it used to load and tokenize differently), a gap, a
repeat, ranks reaching into the block, or, with no named token, more unnamed ids above the
ranks than the 256-id block. The refusal is a ``TokenizerError`` (exit 2) naming the file, the
ranks found and expected and the first missing rank, through ``k3 run --tok``, ``k3.load``
and ``Tokenizer.from_dir``. The shipped and fitted tokenizers still load."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tokenizer.encoding import Tokenizer
from k3core.tokenizer.fit import write_tokenizer
from k3core.tools.synth.writer import synthesize

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
VOCAB = 1024  # the tiny model's: 768 ranks, then the 256-id block ([BOS] at 768)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("rb") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=2)


def _lines(model: Path) -> list[bytes]:
    return (model / "tiktoken.model").read_bytes().splitlines(keepends=True)


def _tok_dir(model: Path, d: Path, lines: list[bytes], config: dict | None = None) -> Path:
    d.mkdir()
    (d / "tiktoken.model").write_bytes(b"".join(lines))
    if config is None:
        shutil.copy(model / "tokenizer_config.json", d)
    else:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def _line(token: bytes, rank: int) -> bytes:
    return base64.b64encode(token) + f" {rank}\n".encode()


def test_a_file_cut_at_a_line_boundary_is_refused_by_k3_run(model, tmp_path):
    cut = _tok_dir(model, tmp_path / "cut", _lines(model)[:300])
    res = CliRunner().invoke(app, ["run", str(model), "--tok", str(cut), "-p", "hello world",
                                   "-n", "1"])
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("k3: error: ")]
    assert len(errors) == 1 and res.stderr.strip().endswith(errors[0])
    msg = errors[0]
    assert str(cut / "tiktoken.model") in msg and "300 ranks where 768 are expected" in msg
    assert "rank 300 is the first missing" in msg and "'[BOS]'" in msg
    assert res.stdout == "" and "Traceback" not in res.output
    whole = _tok_dir(model, tmp_path / "whole", _lines(model))  # the same files, uncut: runs
    res = CliRunner().invoke(app, ["run", str(model), "--tok", str(whole), "-p", "hello world",
                                   "-n", "1"])
    assert res.exit_code == 0, res.output


def test_a_file_cut_short_is_refused_by_the_loader_api(model, tmp_path):
    cut = _tok_dir(model, tmp_path / "cut", _lines(model)[:767])
    with pytest.raises(k3.TokenizerError, match="767 ranks where 768 are expected") as exc:
        Tokenizer.from_dir(cut, vocab_size=VOCAB)
    assert exc.value.exit_code == 2 and str(cut / "tiktoken.model") in str(exc.value)
    assert "rank 767 is the first missing" in str(exc.value)
    with pytest.raises(k3.TokenizerError, match="767 ranks where 768"):
        Tokenizer.from_dir(cut)  # the block's start comes from tokenizer_config.json alone
    with pytest.raises(k3.TokenizerError, match="767 ranks where 768"):
        k3.load(model, tok=cut)


def test_gaps_repeats_and_ranks_in_the_block_are_refused(model, tmp_path):
    lines = _lines(model)
    cases = {
        "gap": (lines[:400] + lines[401:], "rank 400 is missing"),
        "repeat": (lines + [lines[500]], "already given"),
        "rank in the block": (lines + [_line(b"\xfe\xfd\xfc", 768)], "which is a BPE rank"),
        "rank past the block": (lines + [_line(b"\xfe\xfd\xfc", 1100)], "rank 768 is missing"),
    }
    for name, (body, needle) in cases.items():
        d = _tok_dir(model, tmp_path / name.replace(" ", "-"), body)
        with pytest.raises(k3.TokenizerError, match=needle) as exc:
            Tokenizer.from_dir(d, vocab_size=VOCAB)
        assert exc.value.exit_code == 2 and "\n" not in str(exc.value), name


def test_with_no_named_token_the_vocab_size_bounds_the_block(model, tmp_path):
    empty = {"added_tokens_decoder": {}}
    cut = _tok_dir(model, tmp_path / "cut", _lines(model)[:300], empty)
    with pytest.raises(k3.TokenizerError, match="300 ranks where at least 768") as exc:
        Tokenizer.from_dir(cut, vocab_size=VOCAB)
    assert str(cut / "tiktoken.model") in str(exc.value)
    assert "rank 300 is the first missing" in str(exc.value)
    assert Tokenizer.from_dir(cut).n_ranks == 300  # no model vocabulary: nothing to hold it to
    full = _tok_dir(model, tmp_path / "full", _lines(model), empty)
    assert Tokenizer.from_dir(full, vocab_size=VOCAB).n_ranks == 768  # a 256-id block


@pytest.mark.parametrize("vocab", [256, 257, 300, 511, 512, VOCAB, 8192])
def test_fitted_tokenizers_still_load(tmp_path, vocab):
    write_tokenizer(tmp_path, vocab)
    tok = Tokenizer.from_dir(tmp_path, vocab_size=vocab)
    assert tok.n_ranks == min(tok.special_ids, default=vocab)


def test_the_shipped_demo_tokenizer_still_loads():
    tok = Tokenizer.from_dir(DEMO, vocab_size=4096)
    assert tok.n_ranks == 3840 == tok.special_token_id("[BOS]")
