"""Shared by the tokenizer tests: fitted tokenizer directories, built once per session.

The reference encoding here is built independently of ``k3core.tokenizer.encoding``: its own parse
of ``tiktoken.model``, its own read of ``added_tokens_decoder``, and the split pattern
restated from docs/model.md §7.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import tiktoken

from k3core.tokenizer.encoding import Tokenizer
from k3core.tokenizer.fit import write_tokenizer

REAL_VOCAB = 163_840  # 163,584 ranks + the 256-id block, as released

SPEC_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

_DIRS: dict[int, Path] = {}
_TOKS: dict[int, Tokenizer] = {}
_REFS: dict[int, tiktoken.Encoding] = {}


def fitted_dir(factory: pytest.TempPathFactory, vocab: int = REAL_VOCAB) -> Path:
    if vocab not in _DIRS:
        d = factory.mktemp(f"tok{vocab}")
        write_tokenizer(d, vocab)
        _DIRS[vocab] = d
    return _DIRS[vocab]


def fitted_tokenizer(factory: pytest.TempPathFactory, vocab: int = REAL_VOCAB) -> Tokenizer:
    if vocab not in _TOKS:
        _TOKS[vocab] = Tokenizer.from_dir(fitted_dir(factory, vocab))
    return _TOKS[vocab]


def reference_encoding(
    factory: pytest.TempPathFactory, vocab: int = REAL_VOCAB
) -> tiktoken.Encoding:
    if vocab not in _REFS:
        d = fitted_dir(factory, vocab)
        ranks = {}
        for line in (d / "tiktoken.model").read_bytes().splitlines():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        specials = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
        _REFS[vocab] = tiktoken.Encoding(
            name="reference", pat_str=SPEC_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
        )
    return _REFS[vocab]
