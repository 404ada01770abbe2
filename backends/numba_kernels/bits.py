"""Bit-level decoders for stored weights, as LLVM intrinsics so they vectorise in 32-bit lanes.

Numba promotes integer arithmetic to 64 bits; written in plain Numba these decoders would
run at half the SIMD width. Each intrinsic below is a handful of 32-bit integer operations, a
bit cast and an exact widening to float64:

* ``bf16_d(bits)``: bf16 (``uint16``) -> float64. The bf16 pattern is the top half of a
  float32, so ``f32 = bits << 16`` and the widening to float64 is exact.
* ``bf16_even_d(pair)`` / ``bf16_odd_d(pair)``: two bf16 read as one ``uint32``; the first
  is ``pair << 16``, the second ``pair & 0xFFFF0000`` (one 32-bit operation each).
* ``e2m1_lo_d(byte)`` / ``e2m1_hi_d(byte)`` (and ``e2m1_lo_f`` / ``e2m1_hi_f``, the same
  values left in float32): the low / high nibble of an MXFP4 byte
  (``s e e m``) -> ``E2M1[code] * 2**-126`` as float64, exactly. Placing the three magnitude
  bits at float32 bits 22..24 makes a float32 whose exponent field is ``e`` and whose top
  mantissa bit is ``m``: for ``e > 0`` it is ``(1 + m/2) * 2**(e-127)``, for ``e == 0`` the
  subnormal ``m * 2**-127``; both are ``E2M1 * 2**-126``. Bit 3 becomes the sign bit, so
  code 8 gives -0.0 as ``E2M1[8]`` does. Multiplying by ``MX_SCALE[byte] = 2**(byte - 1)``
  (0.0 for the NaN byte 255) gives ``E2M1[code] * E8M0[byte]`` exactly, signed zeros included.

The subnormal step needs the IEEE default environment (no denormals-are-zero), which the
whole contract assumes anyway; :func:`subnormals_honoured` checks it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_F64 = ir.DoubleType()

#: E8M0 byte -> 2**(byte - 1): the factor that turns ``e2m1_*_d`` into ``E2M1 * E8M0``.
MX_SCALE = np.array([0.0 if b == 255 else 2.0 ** (b - 1) for b in range(256)], dtype=np.float64)


def _c(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


@intrinsic
def bf16_d(typingctx, bits):
    """bf16 bit pattern (uint16) -> float64, exactly."""
    sig = types.float64(types.uint16)

    def codegen(context, builder, signature, args):
        f = builder.bitcast(builder.shl(builder.zext(args[0], _I32), _c(16)), _F32)
        return builder.fpext(f, _F64)

    return sig, codegen


def _bf16_pair_intrinsic(name: str, high: bool) -> object:
    """The intrinsic ``name(pair)``: of two bf16 stored side by side and read as one
    little-endian ``uint32``, the first (``pair << 16``) or the second (``pair`` with its
    low half cleared) as float64, exactly: one 32-bit operation, no widening of 16-bit
    lanes."""

    def typer(typingctx, pair):
        sig = types.float64(types.uint32)

        def codegen(context, builder, signature, args):
            bits = (builder.and_(args[0], _c(-(1 << 16))) if high
                    else builder.shl(args[0], _c(16)))
            return builder.fpext(builder.bitcast(bits, _F32), _F64)

        return sig, codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


bf16_even_d = _bf16_pair_intrinsic("bf16_even_d", False)
bf16_odd_d = _bf16_pair_intrinsic("bf16_odd_d", True)


def _nibble_codegen(builder, byte, high):
    """``E2M1 * 2**-126`` as float32 from the low or high nibble of ``byte``, in four integer
    operations each (the separate magnitude and sign masks took five for the low nibble):
    low: the byte shifted by 22 (magnitude to bits 22..24) OR-ed with it shifted by 28 (sign
    to 31), one mask keeping those four bits; high: the byte shifted by 18 (magnitude to
    22..24) under the magnitude mask, OR-ed with the sign-extended byte under bit 31."""
    c = builder.zext(byte, _I32)
    if not high:
        both = builder.or_(builder.shl(c, _c(22)), builder.shl(c, _c(28)))
        return builder.bitcast(builder.and_(both, _c(_E2M1_BITS)), _F32)
    mag = builder.and_(builder.shl(c, _c(18)), _c(0x01C00000))
    sgn = builder.and_(builder.sext(byte, _I32), _c(-(1 << 31)))
    return builder.bitcast(builder.or_(mag, sgn), _F32)


#: Float32 bits 22..24 (the magnitude: exponent field low bits and the top mantissa bit) and
#: 31 (the sign), as a signed 32-bit constant.
_E2M1_BITS = 0x81C00000 - (1 << 32)


def _nibble_intrinsic(name: str, high: bool, wide: bool, doc: str) -> object:
    """The intrinsic ``name(byte)``: the low or high nibble's ``E2M1 * 2**-126``, float32 or
    (``wide``) widened to float64."""

    def typer(typingctx, byte):
        sig = (types.float64 if wide else types.float32)(types.uint8)

        def codegen(context, builder, signature, args):
            f = _nibble_codegen(builder, args[0], high)
            return builder.fpext(f, _F64) if wide else f

        return sig, codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


e2m1_lo_f = _nibble_intrinsic(
    "e2m1_lo_f", False, False, "Low nibble (even column) -> E2M1 * 2**-126 as float32: bits 0..2 "
    "-> 22..24, 3 -> 31.")
e2m1_hi_f = _nibble_intrinsic(
    "e2m1_hi_f", True, False, "High nibble (odd column) -> E2M1 * 2**-126 as float32: bits 4..6 "
    "-> 22..24, 7 -> 31.")
e2m1_lo_d = _nibble_intrinsic(
    "e2m1_lo_d", False, True, "Low nibble (even column) -> E2M1 * 2**-126 as float64.")
e2m1_hi_d = _nibble_intrinsic(
    "e2m1_hi_d", True, True, "High nibble (odd column) -> E2M1 * 2**-126 as float64.")


@intrinsic
def _u32_as_f32(typingctx, bits):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _F32)

    return sig, codegen


@intrinsic
def pow2_d(typingctx, n):
    """``2.0 ** n`` for an int64 ``n`` in ``[-1022, 1023]`` (a normal float64), built from its
    bits: ``(n + 1023) << 52``. Outside that range the result is meaningless; callers select
    it away."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        bits = builder.shl(builder.add(args[0], ir.Constant(i64, 1023)), ir.Constant(i64, 52))
        return builder.bitcast(bits, _F64)

    return sig, codegen


@njit(cache=True, nogil=True)
def subnormals_honoured() -> bool:
    """True when the smallest float32 subnormal survives widening (no DAZ/FTZ in effect)."""
    return np.float64(_u32_as_f32(np.uint32(1))) * 2.0 ** 149 == 1.0
