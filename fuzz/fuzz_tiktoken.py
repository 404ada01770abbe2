"""Fuzz the ``tiktoken.model`` reader (base64 token, space, rank; one per line).

Input: the file's bytes. Accepted ranks must be a permutation of ``0..n-1`` over non-empty
byte strings.
"""

from __future__ import annotations

from fuzz_common import instrumented, main, tiny_model

with instrumented(__name__):
    from k3core.api.errors import K3Error
    from k3core.tokenizer.files import parse_tiktoken_model


def one_input(data: bytes) -> None:
    try:
        ranks = parse_tiktoken_model(data, "fuzz/tiktoken.model")
    except K3Error as exc:
        assert exc.message
        return
    assert ranks and sorted(ranks.values()) == list(range(len(ranks)))
    assert all(isinstance(t, bytes) and t for t in ranks)


def seeds() -> list[bytes]:
    model, _ = tiny_model()
    lines = (model / "tiktoken.model").read_bytes().splitlines(keepends=True)
    return [b"".join(lines[:300]), b"".join(lines[:3]), b"IQ== 0\n"]


if __name__ == "__main__":
    main(one_input, seeds(), "tiktoken")
