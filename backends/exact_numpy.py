"""The kernel contract's primitives in NumPy: the lane sum and the project's own
transcendentals. Every other backend reproduces these bit for bit.

Only IEEE-exact NumPy operations are used (+, -, *, /, sqrt, floor, ldexp, copysign and
conversions), each on its own, so the results do not depend on NumPy's SIMD code paths.
``np.sum``/``dot``/``@`` are never used: their summation order is unspecified.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from k3.plugin import contract as C

F64 = NDArray[np.float64]

_EXP_TOP = C.EXP_COEF[-1]
_EXP_REST = tuple(reversed(C.EXP_COEF[:-1]))
_EXPM1_TOP = C.EXPM1_COEF[-1]
_EXPM1_REST = tuple(reversed(C.EXPM1_COEF[:-1]))


def fold_lanes(acc: F64) -> F64:
    """Fold the last axis (``LANES`` wide) in halves; returns the axis-reduced array."""
    h = C.LANES // 2
    while h >= 1:
        acc = acc[..., :h] + acc[..., h : 2 * h]
        h //= 2
    return acc[..., 0]


def lsum(terms: F64, axis: int = -1) -> F64:
    """The contract's lane sum of float64 ``terms`` along ``axis`` (kept in float64)."""
    t = np.moveaxis(np.asarray(terms, dtype=np.float64), axis, -1)
    n = t.shape[-1]
    chunks = -(-n // C.LANES)
    pad = chunks * C.LANES - n
    if pad:
        t = np.concatenate([t, np.zeros(t.shape[:-1] + (pad,), dtype=np.float64)], axis=-1)
    t = t.reshape(t.shape[:-1] + (chunks, C.LANES))
    acc = np.zeros(t.shape[:-2] + (C.LANES,), dtype=np.float64)
    for c in range(chunks):
        acc += t[..., c, :]
    return fold_lanes(acc)


def exp_d(x: F64) -> F64:
    """exp in float64 by the contract's range reduction and Taylor polynomial."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        n = np.floor(x * C.LOG2E + 0.5)
        n = np.clip(np.nan_to_num(n), -1100.0, 1100.0)
        r = (x - n * C.LN2_HI) - n * C.LN2_LO
        p = np.full_like(r, _EXP_TOP)
        for c in _EXP_REST:
            p = p * r + c
        y = np.ldexp(p, n.astype(np.int32))
    y = np.where(x > C.EXP_HI, np.inf, y)
    y = np.where(x < C.EXP_LO, 0.0, y)
    return np.where(np.isnan(x), np.nan, y)


def expm1_d(x: F64) -> F64:
    """exp(x) - 1 in float64: Taylor series near zero, ``exp_d(x) - 1`` elsewhere."""
    x = np.asarray(x, dtype=np.float64)
    q = np.full_like(x, _EXPM1_TOP)
    for c in _EXPM1_REST:
        q = q * x + c
    with np.errstate(invalid="ignore"):
        small = np.abs(x) < C.EXPM1_SERIES_MAX
    return np.where(small, q * x, exp_d(x) - 1.0)


def tanh_d(x: F64) -> F64:
    """tanh in float64 as ``e / (e + 2)`` with ``e = expm1_d(2|x|)``, saturated beyond 22."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    with np.errstate(invalid="ignore"):
        sat = a > C.TANH_SAT
        e = expm1_d(np.where(sat, 0.0, a) * 2.0)
        t = e / (e + 2.0)
    t = np.where(sat, 1.0, t)
    return np.copysign(t, x)


def sig_d(x: F64) -> F64:
    """The logistic sigmoid in float64: ``1 / (1 + exp_d(-x))``."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + exp_d(-x))


def d(x: NDArray[np.float32]) -> F64:
    """Widen float32 to float64 (exact)."""
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def f32(x: F64) -> NDArray[np.float32]:
    """Round float64 to float32 (round to nearest even)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32)


def bf16_to_f32(bits: NDArray[np.uint16]) -> NDArray[np.float32]:
    """Widen bf16 bit patterns to float32 (an exact 16-bit shift)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


_E2M1 = np.array(C.E2M1, dtype=np.float64)
_E8M0 = np.array(C.E8M0, dtype=np.float64)


def mxfp4_to_f64(packed: NDArray[np.uint8], scales: NDArray[np.uint8]) -> F64:
    """Decode MXFP4 rows to float64 (exact): low nibble = even column, byte 255 = scale 0."""
    rows, half = packed.shape
    codes = np.empty((rows, half * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    vals = _E2M1[codes]
    scale = _E8M0[scales]
    return (vals.reshape(rows, -1, C.MXFP4_GROUP) * scale[:, :, None]).reshape(rows, -1)
