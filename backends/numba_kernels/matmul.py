"""Matrix products ``y[t, o] = f32(lsum_i d(x[t, i]) * W[o, i])`` for bf16, float32 and MXFP4.

Every row keeps its own 32 float64 lane accumulators (lane = column % 32) and folds them at
the end, so the result is the contract's lane sum whatever the thread count; rows are split
across threads with ``prange`` and never share an accumulator. Weights are widened inside
the inner loop (bf16 by a 16-bit shift, MXFP4 nibble by nibble straight from the packed
bytes): no dequantised copy of a matrix is ever made. Per weight the inner loop is one
widening, one multiply by ``d(x)`` and one add; x arrives as float32 (one token, converted in
the loop) or already widened to float64 (several tokens, MXFP4).

MXFP4 rows are handled in their storage order: a byte holds columns ``2k`` (low nibble) and
``2k+1`` (high nibble) of a 32-column group, which is also one lane chunk. The kernels keep
the even lanes and the odd lanes in two 16-wide accumulators (``xe``/``xo`` are the even and
odd columns of ``x``) and interleave them back before the fold; each lane still adds its own
terms in increasing column order, so this is only a change of where a lane is stored.

The products are exact in float64, so the ``*`` then ``+`` per term is the whole rounding
story; ``fastmath=False`` keeps LLVM from reassociating the lane additions.
"""

from __future__ import annotations

import numpy as np
from k3_backends.numba_kernels.bits import MX_SCALE, bf16_d, e2m1_hi_d, e2m1_lo_d
from k3_backends.numba_kernels.exact import JIT, LANES, fold
from k3_backends.numba_kernels.scratch import stack_f64
from numba import carray, njit, prange, types
from numba.extending import overload

PAR = dict(JIT, parallel=True)
HALF = LANES // 2
#: Rows per task in the several-token kernels (each load of x serves RB rows).
RB = 4


def widen(v):  # pragma: no cover - replaced by the overload below inside jitted code
    """Weight element -> float64 (bf16 bits or float32)."""
    raise NotImplementedError


@overload(widen, jit_options=JIT)
def _widen(v):
    if v == types.uint16:
        return lambda v: bf16_d(v)
    if v == types.float32:
        return lambda v: np.float64(v)
    return None


@njit(**PAR)
def dense_t1(w, x0, out0):
    """One token: ``out0[o] = f32(lsum_i d(x0[i]) * widen(w[o, i]))``; ``x0`` float32.

    Two rows per task share each load of ``x``; their lanes live in registers.
    """
    rows, cols = w.shape
    full = cols // LANES
    for pair in prange((rows + 1) // 2):
        o1 = 2 * pair
        o2 = min(o1 + 1, rows - 1)
        a1 = carray(stack_f64(32), 32)
        a2 = carray(stack_f64(32), 32)
        for ln in range(LANES):
            a1[ln] = 0.0
            a2[ln] = 0.0
        w1 = w[o1]
        w2 = w[o2]
        for c in range(full):
            base = c * LANES
            for ln in range(LANES):
                xv = np.float64(x0[base + ln])
                a1[ln] += xv * widen(w1[base + ln])
                a2[ln] += xv * widen(w2[base + ln])
        base = full * LANES
        for ln in range(cols - base):
            xv = np.float64(x0[base + ln])
            a1[ln] += xv * widen(w1[base + ln])
            a2[ln] += xv * widen(w2[base + ln])
        out0[o1] = np.float32(fold(a1))
        out0[o2] = np.float32(fold(a2))


@njit(**PAR)
def dense_tn(w, xd, out):
    """Several tokens (``xd`` float64 ``[T, cols]``): blocks of ``RB`` rows per task, each
    weight chunk widened once and used for every token."""
    rows, cols = w.shape
    T = xd.shape[0]
    full = cols // LANES
    for blk in prange((rows + RB - 1) // RB):
        o0 = blk * RB
        nr = min(RB, rows - o0)
        acc = np.zeros((RB, T, LANES))
        wv = np.zeros((RB, LANES))
        for c in range(full + 1):
            base = c * LANES
            n = min(LANES, cols - base)
            for r in range(nr):
                for ln in range(n):
                    wv[r, ln] = widen(w[o0 + r, base + ln])
            for t in range(T):
                for r in range(nr):
                    for ln in range(n):
                        acc[r, t, ln] += xd[t, base + ln] * wv[r, ln]
        for r in range(nr):
            for t in range(T):
                out[t, o0 + r] = np.float32(fold(acc[r, t]))


@njit(**JIT)
def _fold_split(even, odd):
    """Interleave the even/odd lane halves back into lane order and fold."""
    acc = np.empty(LANES)
    for k in range(HALF):
        acc[2 * k] = even[k]
        acc[2 * k + 1] = odd[k]
    return fold(acc)


@njit(**PAR)
def mxfp4_t1(packed, scales, xe0, xo0, out0):
    """One token from packed MXFP4 rows; ``xe0``/``xo0`` are x's even/odd columns (float64)."""
    rows = packed.shape[0]
    groups = scales.shape[1]
    for o in prange(rows):
        acc_e = carray(stack_f64(16), 16)
        acc_o = carray(stack_f64(16), 16)
        for k in range(HALF):
            acc_e[k] = 0.0
            acc_o[k] = 0.0
        pr = packed[o]
        sr = scales[o]
        for g in range(groups):
            sc = MX_SCALE[sr[g]]
            pb = g * HALF
            for k in range(HALF):
                b = pr[pb + k]
                acc_e[k] += xe0[pb + k] * (e2m1_lo_d(b) * sc)
                acc_o[k] += xo0[pb + k] * (e2m1_hi_d(b) * sc)
        out0[o] = np.float32(_fold_split(acc_e, acc_o))


@njit(**PAR)
def mxfp4_tn(packed, scales, xe, xo, out):
    """Several tokens: blocks of ``RB`` rows, each group decoded once for every token."""
    rows = packed.shape[0]
    groups = scales.shape[1]
    T = xe.shape[0]
    for blk in prange((rows + RB - 1) // RB):
        o0 = blk * RB
        nr = min(RB, rows - o0)
        acc_e = np.zeros((RB, T, HALF))
        acc_o = np.zeros((RB, T, HALF))
        ve = np.zeros((RB, HALF))
        vo = np.zeros((RB, HALF))
        for g in range(groups):
            pb = g * HALF
            for r in range(nr):
                sc = MX_SCALE[scales[o0 + r, g]]
                for k in range(HALF):
                    b = packed[o0 + r, pb + k]
                    ve[r, k] = e2m1_lo_d(b) * sc
                    vo[r, k] = e2m1_hi_d(b) * sc
            for t in range(T):
                for r in range(nr):
                    for k in range(HALF):
                        acc_e[r, t, k] += xe[t, pb + k] * ve[r, k]
                        acc_o[r, t, k] += xo[t, pb + k] * vo[r, k]
        for r in range(nr):
            for t in range(T):
                out[t, o0 + r] = np.float32(_fold_split(acc_e[r, t], acc_o[r, t]))
