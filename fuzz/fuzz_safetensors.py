"""Fuzz the safetensors shard reader: header length, strict JSON header, every entry check.

Input: the bytes of one shard file. Accepted shards must describe tensors that lie inside
the data section, do not overlap and whose byte count matches dtype x shape.
"""

from __future__ import annotations

from pathlib import Path

from fuzz_common import instrumented, main, tiny_model

with instrumented(__name__):
    from k3core.api.errors import K3Error
    from k3core.checkpoint.safetensors_header import DTYPES, header_length, parse_header

PATH = Path("fuzz.safetensors")


def one_input(data: bytes) -> None:
    try:
        if len(data) < 8:
            return  # the index refuses these before parsing (checked in the tests)
        n = header_length(data[:8], len(data), PATH)
        entries = parse_header(data[8 : 8 + n], len(data) - 8 - n, PATH)
    except K3Error as exc:
        assert exc.message and "\n" not in exc.message
        return
    data_size = len(data) - 8 - n
    spans = []
    for e in entries:
        numel = 1
        for d in e.shape:
            numel *= d
        assert 0 <= e.begin <= e.end <= data_size
        assert numel * DTYPES[e.dtype].itemsize == e.end - e.begin
        spans.append((e.begin, e.end))
    spans = sorted(s for s in spans if s[1] > s[0])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def seeds() -> list[bytes]:
    model, _ = tiny_model()
    out = []
    for shard in sorted(model.glob("*.safetensors")):
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        out.append(raw[: 8 + n + 4096])  # header plus the start of the data
    return out


if __name__ == "__main__":
    main(one_input, seeds(), "safetensors", json_dict=True)
