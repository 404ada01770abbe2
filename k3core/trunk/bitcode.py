"""The ``bp-bits`` codec: a bf16 window as 2-4 bit codes of its high bytes plus its low bytes.

``bp-nib`` (:mod:`k3core.trunk.nibble`) gives every high byte a 4-bit code into a table of
fifteen. Bell-shaped weights often need fewer: the high byte is the sign and the top seven
exponent bits, and where seven high bytes cover most of a window's elements, a 3-bit code
into a table of seven plus the rest as escapes, one byte each, stores it in fewer than
``bp-nib``'s 12 bits an element. Where the high bytes spread wider (trained weights) a
4-bit code wins. So each window takes the width, 2, 3 or 4 bits, that stores it smallest,
and a table of the ``2^b - 1`` commonest high bytes; code ``2^b - 1`` (every bit set) is an *escape*, whose high
byte follows the planes. The codes are stored as *bit planes*, 64 elements a group, so a
decoder reads a group's ``b`` planes as ``b`` byte masks (AVX-512) or spreads them to bytes
(AVX2), looks the codes up with one byte shuffle, and finds the group's escapes as the AND
of its planes; their bytes are consecutive in the escape stream, so one expand puts them in
place (``k3core/trunk/bitcode.c``). docs/trunk.md ("Pack it smaller") has the measured
coverage, sizes and decode speeds.

A window of ``m`` little-endian 16-bit elements (``n = 2m`` raw bytes) is stored as

==========  ===========  ===================================================================
bytes       field        meaning
==========  ===========  ===================================================================
1           b            the code width: 2, 3 or 4
3           reserved     zero
4           E            little-endian ``u32``: how many elements are escapes
16          table        the high byte of codes ``0 .. 2^b - 2``; entries from ``2^b - 1``: 0
8 b G       codes        ``G = ceil(m / 64)`` groups of ``b`` little-endian ``u64`` planes: bit
                         ``j`` of group ``g``'s plane ``p`` is bit ``p`` of element
                         ``64 g + j``'s code; bits past ``m`` are zero
m           low plane    every element's low byte, verbatim
E           escapes      the escapes' high bytes, in element order
==========  ===========  ===================================================================

The encoder picks the width and the table deterministically (the commonest high bytes, ties
by value; the smaller width on a tie of sizes). Decoding checks every length before it trusts
it and never takes an escape byte past ``E``, so a damaged window is a
:class:`~k3core.trunk.codec.CodecError`, never a read or a write out of bounds; bytes that
pass those checks but are wrong fail the layer's CRC-32.

The compiled decoder (``k3core.trunk._k3bits``, built by ``setup.py`` where a C compiler is
found) and the NumPy decoder here write the same bytes and refuse the same windows with the
same messages; the tests hold them to it.
"""

from __future__ import annotations

import functools
import struct

import numpy as np

from k3core.trunk.native_decoder import NativeDecoder, decode_window, load

#: the width byte, three reserved bytes, the escape count and the table
HEADER = 24
GROUP = 64
WIDTHS = (2, 3, 4)
_COUNT = struct.Struct("<I")

#: why a window was refused, by the decoder's error code (``bitcode.h``)
REASONS = {
    1: "a bp-bits window decodes to an even, non-zero number of bytes",
    2: "the window is shorter than its 24-byte header",
    3: "its code width is not 2, 3 or 4 bits, or a reserved header byte is not zero",
    4: "a table entry past its code width is not zero",
    5: "it claims more escapes than elements",
    6: "its length does not match its element and escape counts",
    7: "a code bit past the last element is set",
    8: "its codes name a different number of escapes than its header",
}


def stored_bytes(m: int, width: int, escapes: int) -> int:
    """The encoded size of ``m`` elements at ``width`` bits with ``escapes`` escapes."""
    return HEADER + 8 * width * (-(-m // GROUP)) + m + escapes


def encode(raw: np.ndarray) -> bytes:
    """The ``bp-bits`` bytes of ``raw`` (uint8, an even number of bytes of 16-bit elements)."""
    pairs = np.ascontiguousarray(raw).reshape(-1, 2)
    lo, hi = pairs[:, 0], pairs[:, 1]
    m = hi.size
    counts = np.bincount(hi, minlength=256)
    order = np.lexsort((np.arange(256), -counts))
    sizes = {b: stored_bytes(m, b, m - int(counts[order[: (1 << b) - 1]].sum())) for b in WIDTHS}
    width = min(WIDTHS, key=lambda b: (sizes[b], b))
    escape = (1 << width) - 1
    top = order[:escape].astype(np.uint8)
    table = np.zeros(16, np.uint8)
    table[:escape] = top
    code_of = np.full(256, escape, np.uint8)
    code_of[top] = np.arange(escape, dtype=np.uint8)
    groups = -(-m // GROUP)
    codes = np.zeros(groups * GROUP, np.uint8)
    codes[:m] = code_of[hi]
    escapes = hi[codes[:m] == escape]
    planes = np.stack([(codes >> p) & 1 for p in range(width)]).reshape(width, groups, GROUP)
    packed = np.packbits(planes, axis=2, bitorder="little").transpose(1, 0, 2)  # group-major
    head = bytes((width, 0, 0, 0)) + _COUNT.pack(escapes.size) + table.tobytes()
    return b"".join((head, packed.tobytes(), lo.tobytes(), escapes.tobytes()))


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
    width = int(src[0])
    if width not in WIDTHS or src[1:4].any():
        return 3
    escape = (1 << width) - 1
    table = src[8:HEADER]
    if table[escape:].any():
        return 4
    m = n // 2
    (e,) = _COUNT.unpack(src[4:8].tobytes())
    if e > m:
        return 5
    if src.size != stored_bytes(m, width, e):
        return 6
    groups = -(-m // GROUP)
    lo_at = HEADER + 8 * width * groups
    packed = src[HEADER:lo_at].reshape(groups, width, 8)
    bits = np.unpackbits(packed, axis=2, bitorder="little")  # (groups, width, 64)
    if bits[-1, :, m - GROUP * (groups - 1) :].any():
        return 7
    codes = np.zeros((groups, GROUP), np.uint8)
    for p in range(width):
        codes |= bits[:, p, :] << p
    codes = codes.reshape(-1)[:m]
    is_escape = codes == escape
    if int(np.count_nonzero(is_escape)) != e:
        return 8
    pairs = out.reshape(m, 2)
    pairs[:, 0] = src[lo_at : lo_at + m]
    pairs[:, 1] = table[codes]
    pairs[is_escape, 1] = src[lo_at + m :]
    return 0


def native_available() -> bool:
    """Whether the compiled decoder was built and loads."""
    return _native() is not None


def native_vector() -> int:
    """The join the compiled decoder runs here: 2 AVX-512, 1 AVX2, 0 portable (-1: not built)."""
    native = _native()
    return -1 if native is None else native.vector


@functools.cache
def _native() -> NativeDecoder | None:
    """The compiled decoder, or ``None`` where it was not built."""
    return load("k3core.trunk._k3bits", "k3bits")
