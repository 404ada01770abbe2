"""The ``bp-nib`` codec: a bf16 window as 4-bit codes of its high bytes plus its low bytes.

A bf16 weight's high byte is its sign and the top seven bits of its exponent. Bell-shaped
weights (trained or random-normal) use only a few of those values, so the fifteen commonest
high bytes of a window cover nearly all of its elements. So each element keeps its low byte
verbatim and trades its high byte for a 4-bit code into a per-window table of fifteen high
bytes; code 15 marks an *escape*, whose high byte is listed after the planes. That is 12
bits an element, a ratio of 4/3 less the escapes, fewer than ``bp-zstd`` saves; but the
decode is one table shuffle and an interleave per 16 elements (``k3core/trunk/nibble.c``),
far cheaper than a zstd decode. docs/trunk.md ("Pack it smaller") has the measured
coverage, ratios and decode speeds.

A window of ``m`` little-endian 16-bit elements (``n = 2m`` raw bytes) is stored as

======  ==========  ===========================================================
bytes   field       meaning
======  ==========  ===========================================================
16      table       the high byte of codes 0..14; ``table[15]`` is reserved, 0
4       E           little-endian ``u32``: how many elements are escapes
m/2     codes       element ``i``'s code in the low nibble for even ``i`` (rounded up)
m       low plane   every element's low byte, verbatim
4 E     indices     the escapes' element indices, ``u32``, strictly ascending, ``< m``
E       high bytes  the escapes' high bytes
======  ==========  ===========================================================

and an escape's code is 15. The encoder picks the fifteen commonest high bytes (ties by
value, so a pack is deterministic). Decoding checks every length and index before it trusts
it, so a damaged window is a :class:`~k3core.trunk.codec.CodecError`, never a read or a
write out of bounds; bytes that pass those checks but are wrong fail the layer's CRC-32.

The compiled decoder (``k3core.trunk._k3nib``, built by ``setup.py`` where a C compiler is
found) and the NumPy decoder here write the same bytes and refuse the same windows with the
same messages; the tests hold them to it.
"""

from __future__ import annotations

import functools
import struct

import numpy as np

from k3core.trunk.native_decoder import NativeDecoder, decode_window, load

#: the table and the escape count
HEADER = 20
ESCAPE = 15
_COUNT = struct.Struct("<I")

#: why a window was refused, by the decoder's error code (``nibble.h``)
REASONS = {
    1: "a bp-nib window decodes to an even, non-zero number of bytes",
    2: "the window is shorter than its 20-byte header",
    3: "the reserved table entry 15 is not zero",
    4: "it claims more escapes than elements",
    5: "its length does not match its element and escape counts",
    6: "an escape index is out of range or out of order",
    7: "an escape index points at an element whose code is not 15",
}


def stored_bytes(m: int, escapes: int) -> int:
    """The encoded size of ``m`` elements with ``escapes`` escapes."""
    return HEADER + (m + 1) // 2 + m + 5 * escapes


def encode(raw: np.ndarray) -> bytes:
    """The ``bp-nib`` bytes of ``raw`` (uint8, an even number of bytes of 16-bit elements)."""
    pairs = np.ascontiguousarray(raw).reshape(-1, 2)
    lo, hi = pairs[:, 0], pairs[:, 1]
    m = hi.size
    counts = np.bincount(hi, minlength=256)
    top = np.lexsort((np.arange(256), -counts))[:ESCAPE].astype(np.uint8)
    table = np.zeros(16, np.uint8)
    table[:ESCAPE] = top
    code_of = np.full(256, ESCAPE, np.uint8)
    code_of[top] = np.arange(ESCAPE, dtype=np.uint8)
    codes = code_of[hi]
    esc = np.flatnonzero(codes == ESCAPE).astype("<u4")
    if m % 2:
        codes = np.append(codes, np.uint8(0))
    nib = codes[0::2] | (codes[1::2] << 4)
    return b"".join((table.tobytes(), _COUNT.pack(esc.size), nib.tobytes(), lo.tobytes(),
                     esc.tobytes(), hi[esc].tobytes()))


def decode_into(data: memoryview | np.ndarray, out: np.ndarray) -> int:
    """Decode one window into ``out`` (uint8, exactly the raw length): 0, or the error code
    whose :data:`REASONS` entry says why it was refused."""
    return decode_window(_native(), decode_numpy, data, out)


def decode_numpy(data: memoryview | np.ndarray, out: np.ndarray) -> int:
    """:func:`decode_into` without the compiled module: the same checks, the same bytes."""
    src = np.frombuffer(data, np.uint8)
    n = out.size
    if n == 0 or n % 2:
        return 1
    if src.size < HEADER:
        return 2
    table = src[:16]
    if table[15] != 0:
        return 3
    m = n // 2
    (e,) = _COUNT.unpack(src[16:HEADER].tobytes())
    if e > m:
        return 4
    if src.size != stored_bytes(m, e):
        return 5
    nib_end = HEADER + (m + 1) // 2
    codes = np.empty(2 * (nib_end - HEADER), np.uint8)
    packed = src[HEADER:nib_end]
    codes[0::2] = packed & 15
    codes[1::2] = packed >> 4
    codes = codes[:m]
    pairs = out.reshape(m, 2)
    pairs[:, 0] = src[nib_end : nib_end + m]
    pairs[:, 1] = table[codes]
    idx = src[nib_end + m : nib_end + m + 4 * e].view("<u4").astype(np.int64)
    if e:
        # the first bad escape decides, an index check before a code check (as in C)
        bad_index = idx >= m
        bad_index[1:] |= idx[1:] <= idx[:-1]
        bad_code = codes[np.minimum(idx, m - 1)] != ESCAPE
        k_index = int(np.argmax(bad_index)) if bad_index.any() else e
        k_code = int(np.argmax(bad_code)) if bad_code.any() else e
        if k_index < e and k_index <= k_code:
            return 6
        if k_code < e:
            return 7
        pairs[idx, 1] = src[nib_end + m + 4 * e :]
    return 0


def native_available() -> bool:
    """Whether the compiled decoder was built and loads."""
    return _native() is not None


@functools.cache
def _native() -> NativeDecoder | None:
    """The compiled decoder, or ``None`` where it was not built."""
    return load("k3core.trunk._k3nib", "k3nib")
