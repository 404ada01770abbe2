"""Fuzz the ``tiktoken.model`` reader (base64 token, space, rank; one per line) and the
tokenizer built from it.

Input: the file's bytes. Accepted ranks must be a permutation of ``0..n-1`` over non-empty
byte strings; a tokenizer built from them with the tiny model's ``tokenizer_config.json`` and
vocabulary must have its ranks run exactly up to the special-token block (a file cut short,
the first seed, is refused).
"""

from __future__ import annotations

import functools

from fuzz_common import instrumented, main, tiny_model

with instrumented(__name__):
    from k3core.api.errors import K3Error
    from k3core.tokenizer.encoding import Tokenizer
    from k3core.tokenizer.files import AddedToken, parse_tiktoken_model, parse_tokenizer_config

SOURCE = "fuzz/tiktoken.model"


@functools.cache
def _block() -> tuple[dict[int, AddedToken], int]:
    """The tiny model's added tokens and vocabulary size."""
    from k3core.model.config import load_config

    model, _ = tiny_model()
    config = model / "tokenizer_config.json"
    return parse_tokenizer_config(config.read_bytes(), str(config)), \
        load_config(model / "config.json").vocab


def one_input(data: bytes) -> None:
    try:
        ranks = parse_tiktoken_model(data, SOURCE)
    except K3Error as exc:
        assert exc.message
        return
    assert ranks and sorted(ranks.values()) == list(range(len(ranks)))
    assert all(isinstance(t, bytes) and t for t in ranks)
    added, vocab = _block()
    try:
        tok = Tokenizer(ranks, added, vocab_size=vocab, source=SOURCE)
    except K3Error as exc:
        assert exc.message
        return
    assert tok.n_ranks == min(added) and tok.vocab_size == vocab


def seeds() -> list[bytes]:
    model, _ = tiny_model()
    lines = (model / "tiktoken.model").read_bytes().splitlines(keepends=True)
    return [b"".join(lines), b"".join(lines[:300]), b"".join(lines[:3]), b"IQ== 0\n"]


if __name__ == "__main__":
    main(one_input, seeds(), "tiktoken")
