"""Lossless codecs for one window of a packed trunk: encode at pack time, decode into a slot.

A codec is named ``NAME`` or ``NAME:LEVEL`` (``k3 pack-trunk --codec``):

* ``none``: the bytes verbatim (the default; a trunk packed so is the version-1 format);
* ``zstd`` / ``lz4``: the window through Zstandard (``zstandard``) or LZ4 block (``lz4``);
  a zstd level is zstd's own, except level 0, k3's *literal mode*: the fast strategy with
  the smallest match finder (``min_match`` 7, ``hash_log`` 6, ``search_log`` 1), so zstd
  codes the window almost entirely as Huffman literals, which is what bf16 exponent bytes
  need (it encodes and decodes faster than level 3);
* ``bp-zstd`` / ``bp-lz4``: for a window of a two-byte tensor (bf16, f16) the bytes are
  first split into two planes, the high bytes (sign and exponent, few bits of entropy in
  trained weights) and the low bytes (mantissa, nearly 8 bits), and each plane goes
  through the compressor as its own stream (``u32`` length of the high plane's stream, the
  stream, then the low plane's, or the low plane raw when its encoding saves under 1/64,
  flagged by the length's top bit: one decode per window for the mantissas' nearly 8 bits
  of entropy is not worth its time), so the entropy coder never mixes the two distributions
  (one zstd block of up to 128 KiB shares one Huffman table: a single stream of both planes
  gains nothing on a small window); decode joins them back with one 16-bit shift-or.
  Windows of other dtypes go through the compressor as they are. ``bp-zstd`` defaults to level 0.
* ``bp-nib``: for a window of a two-byte tensor, each element's low byte verbatim and its
  high byte as a 4-bit code into the window's table of its fifteen commonest high bytes, the
  rest listed as escapes (:mod:`k3core.trunk.nibble`): a ratio near 4/3, below
  ``bp-zstd``'s, decoded far faster (a compiled shuffle loop, NumPy where it was not
  built). Windows of other dtypes are stored raw.
* ``bp-bits``: like ``bp-nib``, with each window's high bytes as 2-, 3- or 4-bit codes,
  whichever width stores the window smallest, kept as bit planes (:mod:`k3core.trunk.bitcode`):
  bell-shaped weights take 3 bits, fewer bytes than ``bp-nib``'s 12 bits an element,
  decoded by one byte shuffle and one expand per 64 elements on AVX-512.

A window whose encoding is not smaller than its raw bytes is stored raw (the pack decides
per window; the manifest's window table says which, see :mod:`k3core.trunk.windows`).
Decoding is bounded: at most the window's recorded raw length is produced, and anything
else (a library error, a short or long result) is a :class:`CodecError`; the caller names
the layer and window. ``docs/trunk.md`` has the measured ratios and decode speeds.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from k3core.api.errors import UsageError
from k3core.trunk import bitcode, nibble

if TYPE_CHECKING:
    import zstandard

#: the codec names a manifest may carry and ``--codec`` accepts
NAMES = ("none", "zstd", "lz4", "bp-zstd", "bp-lz4", "bp-nib", "bp-bits")
DEFAULT_LEVEL = {"zstd": 3, "bp-zstd": 0, "lz4": 0, "bp-lz4": 0, "bp-nib": 0, "bp-bits": 0,
                 "none": 0}
LEVELS = {"zstd": range(-7, 23), "bp-zstd": range(-7, 23), "lz4": range(0, 17),
          "bp-lz4": range(0, 17), "bp-nib": range(0, 1), "bp-bits": range(0, 1),
          "none": range(0, 1)}
#: the codecs that code a two-byte window's high bytes in place of a compressor: the module
#: with the format's ``encode``, ``decode_into`` and refusal ``REASONS``
HIGH_BYTE_CODES = {"bp-nib": nibble, "bp-bits": bitcode}


class CodecError(Exception):
    """A window that does not decode to its recorded raw length."""


@dataclass(frozen=True)
class Codec:
    name: str
    level: int

    @property
    def spec(self) -> str:
        return self.name if self.name == "none" else f"{self.name}:{self.level}"

    @property
    def planes(self) -> bool:
        return self.name.startswith("bp-")

    @property
    def base(self) -> str:
        return self.name.removeprefix("bp-")

    def encode(self, raw: np.ndarray, itemsize: int) -> bytes:
        """The encoded bytes of ``raw`` (uint8) from a tensor of ``itemsize``-byte elements."""
        coder = HIGH_BYTE_CODES.get(self.name)
        if coder is not None:
            return coder.encode(raw) if self._split(raw.size, itemsize) else raw.tobytes()
        if self._split(raw.size, itemsize):
            planes = split_planes(raw)
            hi = self._encode(planes[: raw.size // 2])
            lo_raw = planes[raw.size // 2 :]
            lo = self._encode(lo_raw)
            if len(lo) > lo_raw.size - lo_raw.size // 64:  # mantissas: not worth a decode
                return _HI_LEN.pack(len(hi) | _LO_RAW) + hi + lo_raw.tobytes()
            return _HI_LEN.pack(len(hi)) + hi + lo
        return self._encode(raw)

    def decode_into(self, data: memoryview | np.ndarray, out: np.ndarray, itemsize: int) -> None:
        """Decode ``data`` into ``out`` (uint8, exactly the window's raw length)."""
        n = out.size
        data = data if isinstance(data, memoryview) else data.data
        if not self._split(n, itemsize):
            out[:] = np.frombuffer(self._decode(data, n), dtype=np.uint8)
            return
        coder = HIGH_BYTE_CODES.get(self.name)
        if coder is not None:
            code = coder.decode_into(data, out)
            if code:
                raise CodecError(f"{self.name}: {coder.REASONS[code]}")
            return
        if len(data) < _HI_LEN.size:
            raise CodecError(f"{self.name}: {len(data)} bytes cannot hold two planes")
        (head,) = _HI_LEN.unpack(data[: _HI_LEN.size])
        hi_len = head & ~_LO_RAW
        if hi_len > len(data) - _HI_LEN.size:
            raise CodecError(f"{self.name}: the high plane's {hi_len} bytes run past the window")
        hi = self._decode(data[_HI_LEN.size : _HI_LEN.size + hi_len], n // 2)
        rest = data[_HI_LEN.size + hi_len :]
        if head & _LO_RAW:
            if len(rest) != n // 2:
                raise CodecError(f"{self.name}: the raw low plane is {len(rest)} bytes, "
                                 f"not {n // 2}")
            lo: bytes | memoryview = rest
        else:
            lo = self._decode(rest, n // 2)
        join_planes(np.frombuffer(hi, np.uint8), np.frombuffer(lo, np.uint8), out)

    def _split(self, n: int, itemsize: int) -> bool:
        return self.planes and itemsize == 2 and n % 2 == 0

    def _encode(self, src: np.ndarray) -> bytes:
        src = np.ascontiguousarray(src)
        if self.base == "zstd":
            import zstandard

            if self.level == 0:  # literal mode: the smallest match finder, Huffman literals
                params = zstandard.ZstdCompressionParameters(
                    compression_level=1, strategy=zstandard.STRATEGY_FAST, min_match=7,
                    hash_log=6, search_log=1)
                return zstandard.ZstdCompressor(compression_params=params).compress(src.data)
            return zstandard.ZstdCompressor(level=self.level).compress(src.data)
        if self.base == "lz4":
            import lz4.block

            mode = "high_compression" if self.level > 0 else "default"
            return bytes(lz4.block.compress(src.data, mode=mode, compression=self.level,
                                            store_size=False))
        return src.tobytes()

    def _decode(self, data: memoryview, n: int) -> bytes:
        """Exactly ``n`` decoded bytes of one stream, or ``CodecError``."""
        try:
            if self.base == "zstd":
                import zstandard

                claimed = zstandard.frame_content_size(data)
                if claimed != n:  # never let a damaged frame size the allocation
                    raise CodecError(f"{self.name} frame claims {claimed} bytes, not {n}")
                got = _zstd().decompress(data, max_output_size=n)
            elif self.base == "lz4":
                import lz4.block

                got = lz4.block.decompress(data, uncompressed_size=n)
            else:
                got = bytes(data)
        except CodecError:
            raise
        except Exception as exc:  # any library error is a damaged window
            raise CodecError(f"{self.name} cannot decode it ({type(exc).__name__}: {exc})") from None
        if len(got) != n:
            raise CodecError(f"{self.name} decodes it to {len(got)} bytes, not {n}")
        return got


#: a byte-plane window starts with the high plane's encoded length; the top bit set means
#: the low plane follows raw (its encoding saved under 1/64 of it, as mantissas usually do)
_HI_LEN = struct.Struct("<I")
_LO_RAW = 1 << 31


def split_planes(raw: np.ndarray) -> np.ndarray:
    """Little-endian 16-bit elements as two planes: every high byte, then every low byte."""
    pairs = raw.reshape(-1, 2)
    return np.concatenate([pairs[:, 1], pairs[:, 0]])


def join_planes(hi: np.ndarray, lo: np.ndarray, out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`: the planes' bytes interleaved into ``out`` (uint8)."""
    o16 = out.view(np.uint16)
    np.left_shift(hi, 8, out=o16, dtype=np.uint16)
    np.bitwise_or(o16, lo, out=o16)


_local = threading.local()


def _zstd() -> zstandard.ZstdDecompressor:
    """One decompression context per thread (a context is not shared across threads)."""
    d = getattr(_local, "zstd", None)
    if d is None:
        import zstandard

        d = _local.zstd = zstandard.ZstdDecompressor()
    return d


def parse_codec(spec: str) -> Codec:
    """``NAME`` or ``NAME:LEVEL`` as a :class:`Codec`; ``UsageError`` (exit 2) otherwise."""
    name, _, lvl = spec.strip().partition(":")
    if name not in NAMES:
        raise UsageError(f"--codec {spec!r}: unknown codec (known: {', '.join(NAMES)})")
    level = DEFAULT_LEVEL[name]
    if lvl:
        try:
            level = int(lvl)
        except ValueError:
            raise UsageError(f"--codec {spec!r}: the level must be an integer") from None
        if level not in LEVELS[name]:
            r = LEVELS[name]
            raise UsageError(f"--codec {spec!r}: {name} levels are {r.start}..{r.stop - 1}")
    return Codec(name, level)


def codec_for_manifest(name: str) -> Codec:
    """The decoder a manifest names (the level does not matter to decoding)."""
    if name not in NAMES:
        raise ValueError(name)
    return Codec(name, DEFAULT_LEVEL[name])
