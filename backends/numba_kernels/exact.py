"""The kernel contract's scalar primitives as Numba functions.

These reproduce :mod:`k3_backends.exact_numpy` value by value: the same constants from
:mod:`k3core.api.contract`, the same operation order, each float64 or float32 operation rounded
on its own (``fastmath=False``: LLVM neither contracts ``a*b+c`` into an FMA nor reorders).
Like the vectorised NumPy versions, ``exp_d``, ``expm1_d`` and ``tanh_d`` compute every
branch and select (so that LLVM vectorises the element-wise loops that use them), which
gives the same value for every input:

* ``exp_d``: NaN -> NaN, ``x > EXP_HI`` -> +inf, ``x < EXP_LO`` -> +0.0, else the reduction
  (inside ``[EXP_LO, EXP_HI]``, ``n`` is far inside the reference's ``[-1100, 1100]`` clip);
* ``expm1_d``: the series only when ``|x| < EXPM1_SERIES_MAX`` (NaN takes the other branch);
* ``tanh_d``: saturated to 1 beyond ``TANH_SAT``, sign restored with ``copysign``.

Kernels call these as ordinary jitted functions; LLVM inlines them into the loops. The
element-wise ones (``exp_d``, ``expm1_d``, ``tanh_d``, ``sig_d``, ``silu_f``) are inlined by
Numba itself (``inline="always"``): called, they stayed calls, and no loop using them was
vectorised.
"""

from __future__ import annotations

import math

import numpy as np
from k3_backends.numba_kernels.bits import pow2_d
from k3_backends.numba_kernels.jit import JIT
from numba import njit

from k3.plugin import contract as C

LANES = C.LANES
EXP_HI = C.EXP_HI
EXP_LO = C.EXP_LO
LOG2E = C.LOG2E
LN2_HI = C.LN2_HI
LN2_LO = C.LN2_LO
EXPM1_SERIES_MAX = C.EXPM1_SERIES_MAX
TANH_SAT = C.TANH_SAT
L2_EPS = C.L2_EPS
ROUTER_EPS = C.ROUTER_EPS
(E0, E1, E2, E3, E4, E5, E6, E7, E8, E9, E10, E11, E12, E13) = C.EXP_COEF
(M1, M2, M3, M4, M5, M6, M7, M8, M9, M10, M11, M12, M13, M14, M15, M16, M17) = C.EXPM1_COEF


@njit(inline="always", **JIT)
def exp_d(x):
    """The contract's exp in float64 (range reduction + degree-13 Taylor, Horner from top).

    Written without a branch or a call, so that LLVM vectorises the loops that inline it
    (the SiTU, the gates, the sigmoids): the reduction runs on ``x`` clamped into
    ``[EXP_LO, EXP_HI]`` and the special cases are selected at the end. ``2**n`` is built
    from its bits: inside the range ``n`` is in ``[-1021, 1023]`` and ``p`` in about
    ``[0.70, 1.42]`` (0.914 at ``n = 1023``), so ``p * 2**n`` is a normal number, exact, and
    equal to ``ldexp(p, n)``.
    """
    xc = x if x > EXP_LO else EXP_LO  # NaN takes EXP_LO; it is replaced below
    xc = xc if xc < EXP_HI else EXP_HI
    n = np.floor(xc * LOG2E + 0.5)
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = E13
    p = p * r + E12
    p = p * r + E11
    p = p * r + E10
    p = p * r + E9
    p = p * r + E8
    p = p * r + E7
    p = p * r + E6
    p = p * r + E5
    p = p * r + E4
    p = p * r + E3
    p = p * r + E2
    p = p * r + E1
    p = p * r + E0
    v = p * pow2_d(np.int64(n))
    v = 0.0 if x < EXP_LO else v
    v = np.inf if x > EXP_HI else v
    return np.nan if x != x else v


@njit(inline="always", **JIT)
def expm1_d(x):
    """exp(x) - 1: Taylor series (1/1! .. 1/17!) for |x| < 0.5, else exp_d(x) - 1 (both
    computed, one selected: no branch, see :func:`exp_d`)."""
    q = M17
    q = q * x + M16
    q = q * x + M15
    q = q * x + M14
    q = q * x + M13
    q = q * x + M12
    q = q * x + M11
    q = q * x + M10
    q = q * x + M9
    q = q * x + M8
    q = q * x + M7
    q = q * x + M6
    q = q * x + M5
    q = q * x + M4
    q = q * x + M3
    q = q * x + M2
    q = q * x + M1
    series = q * x
    other = exp_d(x) - 1.0
    return series if abs(x) < EXPM1_SERIES_MAX else other


@njit(inline="always", **JIT)
def tanh_d(x):
    """tanh as e / (e + 2), e = expm1_d(2|x|); +-1 beyond TANH_SAT; sign via copysign
    (no branch, see :func:`exp_d`)."""
    a = abs(x)
    e = expm1_d(a * 2.0)
    t = e / (e + 2.0)
    t = 1.0 if a > TANH_SAT else t
    return math.copysign(t, x)


@njit(inline="always", **JIT)
def sig_d(x):
    """Logistic sigmoid in float64: 1 / (1 + exp_d(-x))."""
    return 1.0 / (1.0 + exp_d(-x))


@njit(inline="always", **JIT)
def silu_f(x):
    """float32 -> float32 SiLU: f32(d(x) * sig_d(d(x)))."""
    xd = np.float64(x)
    return np.float32(xd * sig_d(xd))


@njit(**JIT)
def fold(acc):
    """Fold a LANES-long float64 lane array in halves (lane j += lane j+h); returns lane 0."""
    h = LANES // 2
    while h >= 1:
        for j in range(h):
            acc[j] = acc[j] + acc[j + h]
        h //= 2
    return acc[0]


@njit(**JIT)
def fold_rows(acc, width, used):
    """Fold ``acc[LANES, :width]`` over its first axis in halves; the result is ``acc[0]``.

    Only the first ``used`` lanes may be non-zero; the rest hold +0.0 and are skipped. That
    is exact: a lane starts at +0.0 and ``+0.0 + t`` is never -0.0, so no lane is ever -0.0
    and adding a +0.0 lane leaves it bit for bit unchanged (NaN included).
    """
    h = LANES // 2
    while h >= 1:
        for j in range(min(h, max(used - h, 0))):
            for c in range(width):
                acc[j, c] = acc[j, c] + acc[j + h, c]
        used = min(used, h)
        h //= 2


@njit(**JIT)
def sumsq_f32(x, acc):
    """lsum(d(x)^2) of a 1-D float32 array, using ``acc`` (LANES float64) as scratch."""
    acc[:] = 0.0
    n = x.shape[0]
    full = n // LANES
    for c in range(full):
        base = c * LANES
        for ln in range(LANES):
            v = np.float64(x[base + ln])
            acc[ln] += v * v
    base = full * LANES
    for ln in range(n - base):
        v = np.float64(x[base + ln])
        acc[ln] += v * v
    return fold(acc)


@njit(**JIT)
def dot_into(acc, a, b, offset):
    """Add the terms ``d(a[i]) * d(b[i])`` to lanes ``(offset + i) % LANES`` of ``acc``."""
    n = a.shape[0]
    if offset % LANES == 0:
        full = n // LANES
        for c in range(full):
            base = c * LANES
            for ln in range(LANES):
                acc[ln] += np.float64(a[base + ln]) * np.float64(b[base + ln])
        for i in range(full * LANES, n):
            acc[i - full * LANES] += np.float64(a[i]) * np.float64(b[i])
    else:
        for i in range(n):
            acc[(offset + i) % LANES] += np.float64(a[i]) * np.float64(b[i])


@njit(**JIT)
def max_nan(s, n):
    """``np.max(s[:n])``: the largest value, NaN if any is NaN (n >= 1)."""
    m = s[0]
    for i in range(n):
        v = s[i]
        if v != v:
            return v
        if v > m:
            m = v
    return m
