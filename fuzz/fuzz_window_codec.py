"""Fuzz the trunk's window decoders of the two high-byte codecs (``bp-nib``, ``bp-bits``).

Input: one control byte (bit 0: the codec; the rest: how many raw bytes the window claims,
as a signed change of up to 64 elements from what its header implies), then the encoded
window. Every decoder (NumPy's, and each compiled join this CPU has) must give the same
answer: the same refusal code, or the same bytes; the codec then raises one
:class:`~k3core.trunk.codec.CodecError` naming the reason, or fills the window.
"""

from __future__ import annotations

import struct
from functools import partial

import numpy as np
from fuzz_common import instrumented, main

with instrumented(__name__):
    from k3core.trunk import bitcode, nibble
    from k3core.trunk.codec import CodecError, parse_codec

CODECS = ("bp-nib", "bp-bits")


def _implied_elements(codec: str, window: bytes) -> int:
    """The element count the window's sizes suggest (a plausible output length to try)."""
    if codec == "bp-nib":
        if len(window) < nibble.HEADER:
            return 1
        (e,) = struct.unpack("<I", window[16:20])
        return max(1, (len(window) - nibble.HEADER - 5 * min(e, len(window))) * 2 // 3)
    if len(window) < bitcode.HEADER:
        return 1
    width = max(2, min(4, window[0]))
    (e,) = struct.unpack("<I", window[4:8])
    return max(1, (len(window) - bitcode.HEADER - min(e, len(window))) * 64 // (64 + 8 * width))


def _decoders(codec: str) -> list:
    """NumPy's decoder, then the compiled one at each join this CPU runs."""
    coder = nibble if codec == "bp-nib" else bitcode
    out = [coder.decode_numpy]
    native = coder._native()
    if native is not None:
        out += [partial(native.decode, vector=v) for v in range(native.vector + 1)]
    return out


def one_input(data: bytes) -> None:
    if not data:
        return
    codec = CODECS[data[0] & 1]
    window = data[1:]
    m = max(0, _implied_elements(codec, window) + (data[0] >> 1) - 64)
    n = 2 * m + (1 if data[0] == 0xFF else 0)  # now and then an odd length
    results = []
    for decode in _decoders(codec):
        guard = np.full(n + 64, 0x5A, np.uint8)
        code = decode(window, guard[:n])
        assert (guard[n:] == 0x5A).all(), "a decoder wrote past the window"
        results.append((code, guard[:n].tobytes() if code == 0 else b""))
    assert len(set(results)) == 1, (codec, [r[0] for r in results])
    out = np.empty(n, np.uint8)
    try:
        parse_codec(codec).decode_into(memoryview(window), out, 2)
    except CodecError as exc:
        assert (results[0][0] != 0 or n % 2) and str(exc).startswith(codec)
        return
    if n % 2:  # not a window of whole elements: the codec only ever stores those raw
        assert out.tobytes() == window
        return
    assert results[0][0] == 0 and out.tobytes() == results[0][1]


def seeds() -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for count, scale in ((300, 0.02), (70, 1e6), (64, 0.02), (1, 1.0)):
        vals = (rng.standard_normal(count).astype(np.float32) * scale).view(np.uint32) >> 16
        raw = vals.astype("<u2").view(np.uint8)
        for bit, codec in enumerate(CODECS):
            window = (nibble if codec == "bp-nib" else bitcode).encode(raw)
            shift = count - _implied_elements(codec, window) + 64  # the window's own length
            out.append(bytes([shift << 1 | bit]) + window)
    return out


if __name__ == "__main__":
    main(one_input, seeds(), "window_codec")
