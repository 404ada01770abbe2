"""Fuzz the ``tokenizer_config.json`` reader (added special tokens).

Input: the file's bytes. Accepted entries map each id to one named token.
"""

from __future__ import annotations

from fuzz_common import instrumented, main, tiny_model

with instrumented(__name__):
    from k3core.api.errors import K3Error
    from k3core.tokenizer.files import parse_tokenizer_config


def one_input(data: bytes) -> None:
    try:
        added = parse_tokenizer_config(data, "fuzz/tokenizer_config.json")
    except K3Error as exc:
        assert exc.message
        return
    for i, tok in added.items():
        assert isinstance(i, int) and i >= 0 and tok.id == i and isinstance(tok.content, str)


def seeds() -> list[bytes]:
    model, _ = tiny_model()
    return [(model / "tokenizer_config.json").read_bytes(), b"{}",
            b'{"added_tokens_decoder": {"5": {"content": "[BOS]", "special": true}}}']


if __name__ == "__main__":
    main(one_input, seeds(), "tokenizer_config", json_dict=True)
