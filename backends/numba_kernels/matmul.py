"""Matrix products ``y[t, o] = f32(lsum_i d(x[t, i]) * W[o, i])`` for bf16, float32 and MXFP4.

Every row keeps its own 32 float64 lane accumulators (lane = column % 32) and folds them at
the end, so the result is the contract's lane sum whatever the thread count; rows are split
across threads with ``prange`` and never share an accumulator. Weights are widened inside
the inner loop (bf16 by a 16-bit shift, MXFP4 nibble by nibble straight from the packed
bytes; a one-token MXFP4 row decodes eight groups at a time into a float32 slot on the stack
first, see ``_mxfp4_t1``): no dequantised copy of a matrix is ever made. Per weight the inner loop is one
widening, one multiply by ``d(x)`` and one add; x arrives already widened to float64 (the
caller widens it once a call). Several tokens are taken
four at a time, so each weight is widened once per four tokens; the caller pads x with zero
rows to a multiple of four and the padding's results are never written.

MXFP4 rows are handled in their storage order: a byte holds columns ``2k`` (low nibble) and
``2k+1`` (high nibble) of a 32-column group, which is also one lane chunk. The kernels keep
the even lanes and the odd lanes in two 16-wide accumulators (``xe``/``xo`` are the even and
odd columns of ``x``) and interleave them back before the fold; each lane still adds its own
terms in increasing column order, so this is only a change of where a lane is stored.

The products are exact in float64, so the ``*`` then ``+`` per term is the whole rounding
story; these kernels are compiled with the single fast-math flag ``contract`` (LLVM may fuse
``acc + x * w`` into an FMA, which rounds the exact product's sum once, as the separate ops
do) and nothing else: no reassociation of the lane additions, no other approximation.
"""

from __future__ import annotations

import numpy as np
from k3_backends.numba_kernels.bits import (
    MX_SCALE,
    bf16_d,
    bf16_even_d,
    bf16_odd_d,
    e2m1_hi_d,
    e2m1_hi_f,
    e2m1_lo_d,
    e2m1_lo_f,
)
from k3_backends.numba_kernels.exact import LANES, fold
from k3_backends.numba_kernels.jit import JIT, LANE_SUM, twins
from k3_backends.numba_kernels.prefetch import prefetch
from k3_backends.numba_kernels.scratch import stack_f32, stack_f64
from numba import carray, njit, prange, types
from numba.extending import overload

HALF = LANES // 2
AHEAD = 16384  # elements of a row prefetched ahead of the one-token products
AHEAD_MX = 4096  # packed MXFP4 bytes prefetched ahead


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


def _dense_t1(w, x0, out0):
    """One token: ``out0[o] = f32(lsum_i x0[i] * widen(w[o, i]))``; ``x0`` is the token
    widened to float64 (exact) by the caller.

    Two rows per task share each load of ``x``; their lanes live in registers. Widening
    ``x`` once per call rather than in every task's loop: one Zen 4 thread, bf16
    [14464 x 1536] from memory, 8.0 -> 9.9 GMAC/s (three alternating runs); four rows a
    task measured no faster than two.
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
            prefetch(w1, base + AHEAD)
            prefetch(w2, base + AHEAD)
            if w.itemsize == 4:  # float32: a chunk is two lines
                prefetch(w1, base + AHEAD + 16)
                prefetch(w2, base + AHEAD + 16)
            for ln in range(LANES):
                xv = x0[base + ln]
                a1[ln] += xv * widen(w1[base + ln])
                a2[ln] += xv * widen(w2[base + ln])
        base = full * LANES
        for ln in range(cols - base):
            xv = x0[base + ln]
            a1[ln] += xv * widen(w1[base + ln])
            a2[ln] += xv * widen(w2[base + ln])
        out0[o1] = np.float32(fold(a1))
        out0[o2] = np.float32(fold(a2))


def _bf16_t1_pairs(wp, xe0, xo0, out0):
    """One token through bf16 rows of whole 32-column chunks, each row read as ``uint32``
    pairs of weights (``wp``: ``[rows, cols / 2]``): a pair's first weight is ``pair << 16``
    and its second ``pair & 0xFFFF0000``, one operation each where widening 16-bit words
    takes a zero-extension and a shift. The even and odd columns add into two 16-lane
    halves against the token's even and odd columns (``xe0``/``xo0``, float64), interleaved
    back before the fold as the MXFP4 rows do: every lane adds its own terms in order, so
    the bits are :func:`_dense_t1`'s. Two rows per task share each load of ``x``."""
    rows, half = wp.shape
    for pair in prange((rows + 1) // 2):
        o1 = 2 * pair
        o2 = min(o1 + 1, rows - 1)
        e1 = carray(stack_f64(16), 16)
        d1 = carray(stack_f64(16), 16)
        e2 = carray(stack_f64(16), 16)
        d2 = carray(stack_f64(16), 16)
        for k in range(HALF):
            e1[k] = 0.0
            d1[k] = 0.0
            e2[k] = 0.0
            d2[k] = 0.0
        w1 = wp[o1]
        w2 = wp[o2]
        for c in range(half // HALF):
            base = c * HALF
            prefetch(w1, base + AHEAD // 2)
            prefetch(w2, base + AHEAD // 2)
            for k in range(HALF):
                xe = xe0[base + k]
                xo = xo0[base + k]
                u1 = w1[base + k]
                u2 = w2[base + k]
                e1[k] += xe * bf16_even_d(u1)
                d1[k] += xo * bf16_odd_d(u1)
                e2[k] += xe * bf16_even_d(u2)
                d2[k] += xo * bf16_odd_d(u2)
        out0[o1] = np.float32(_fold_split(e1, d1))
        out0[o2] = np.float32(_fold_split(e2, d2))


def _dense_t4(w, xd, out, tiles):
    """Several tokens: lane-pass tiles of four rows by four tokens.

    ``xd`` is float64 ``[T4, cols]`` with ``T4`` a multiple of 4 (rows past ``out.shape[0]``
    are zero padding whose results are dropped). Lane ``l`` of a (row, token) sum only ever
    receives the columns ``32c + l``, in increasing ``c``, so the 32 lanes are computed in
    four passes of eight (pass ``k``: lanes ``8k .. 8k + 7``): a pass keeps 16 accumulators
    of eight lanes (four rows by four tokens), each weight widened once for four tokens and
    each activation loaded once for four rows, and stores them into the tile's 32-lane sums
    for the fold. Each lane adds its terms from +0.0 in increasing column order, so the bits
    are the one-row, one-token sum's. A row tile past the last row multiplies +0.0 weights
    and writes nothing. One Zen 4 thread, bf16 [1536 x 1536] x 120 tokens: 15.3 GMAC/s
    against 9.9 for four tokens a row with all 32 lanes; in the backend 9.6 -> 13.4-13.9
    (docs/measurements/2026-12-07-numba-decode-zen4.md).

    A task is ``tiles`` row tiles (the caller sizes them so their weights stay in the core's
    L2), taken one token quad at a time over all of its tiles, so a quad's activations are
    reused by every tile of the task. Two Zen 4 threads, 128 tokens, six alternating rounds
    against one tile a task: [1536 x 1344] 11.0 -> 9.2 ms, [1536 x 1536] no change.
    """
    rows, cols = w.shape
    T = out.shape[0]
    full = cols // LANES
    ntile = (rows + 3) // 4
    for task in prange((ntile + tiles - 1) // tiles):
        lanes = carray(stack_f64(512), 512)  # 4 rows x 4 tokens x 32 lanes
        acc = carray(stack_f64(128), 128)  # 4 rows x 4 tokens x 8 lanes of one pass
        for t0 in range(0, xd.shape[0], 4):
            for rt in range(task * tiles, min(ntile, task * tiles + tiles)):
                r0 = rt * 4
                if r0 + 4 <= rows:
                    _dense_tile(w, xd, t0, r0, rows, cols, full, acc, lanes, True)
                else:
                    _dense_tile(w, xd, t0, r0, rows, cols, full, acc, lanes, False)
                for r in range(4):
                    rr = r0 + r
                    if rr < rows:
                        for t in range(4):
                            if t0 + t < T:
                                q = (r * 4 + t) * 32
                                out[t0 + t, rr] = np.float32(fold(lanes[q : q + 32]))


@njit(inline="always", **JIT)
def _dense_tile(w, xd, t0, r0, rows, cols, full, acc, lanes, whole):
    """The 32-lane sums of rows ``r0 .. r0 + 3`` by tokens ``t0 .. t0 + 3`` into ``lanes``
    (``[row * 4 + token][32]``), four passes of eight lanes through ``acc`` (see
    :func:`_dense_t4`). Inlined, so the stack slots are the caller's and its lane sums take
    the caller's ``contract`` flag. ``whole`` (a constant at each call): all four rows exist,
    and the inner loop checks none of them (checked, every row was a branch of its own)."""
    for k in range(4):
        for i in range(128):
            acc[i] = 0.0
        for c in range(full):
            b = c * LANES + 8 * k
            for j in range(8):
                col = b + j
                x0 = xd[t0, col]
                x1 = xd[t0 + 1, col]
                x2 = xd[t0 + 2, col]
                x3 = xd[t0 + 3, col]
                for r in range(4):
                    rr = r0 + r
                    wv = widen(w[rr, col]) if whole or rr < rows else 0.0
                    acc[(r * 4 + 0) * 8 + j] += x0 * wv
                    acc[(r * 4 + 1) * 8 + j] += x1 * wv
                    acc[(r * 4 + 2) * 8 + j] += x2 * wv
                    acc[(r * 4 + 3) * 8 + j] += x3 * wv
        for col in range(full * LANES + 8 * k, min(cols, full * LANES + 8 * k + 8)):
            j = col - full * LANES - 8 * k  # the tail chunk's columns of this pass
            for r in range(4):
                rr = r0 + r
                wv = widen(w[rr, col]) if rr < rows else 0.0
                for t in range(4):
                    acc[(r * 4 + t) * 8 + j] += xd[t0 + t, col] * wv
        for i in range(16):
            for j in range(8):
                lanes[i * 32 + 8 * k + j] = acc[i * 8 + j]


assert LANES == 32  # the stack slots below


@njit(**JIT)
def _fold_split(even, odd):
    """Interleave the even/odd lane halves back into lane order and fold (on the stack: a
    heap array here was one allocation per row)."""
    acc = carray(stack_f64(32), 32)
    for k in range(HALF):
        acc[2 * k] = even[k]
        acc[2 * k + 1] = odd[k]
    return fold(acc)


MX_BLOCK = 8  # groups of a one-token MXFP4 row decoded ahead of their products
assert MX_BLOCK * HALF == 128  # the stack slots below


def _mxfp4_t1(packed, scales, xe0, xo0, out0):
    """One token from packed MXFP4 rows; ``xe0``/``xo0`` are x's even/odd columns (float64).

    A row goes MX_BLOCK groups at a time: their bytes are first decoded to float32 into two
    stack slots (even and odd columns), a loop of integer operations only, which LLVM runs
    eight lanes wide; then each weight is widened, scaled and added to its lane, four lanes
    wide. Decoded inside the product loop, every integer operation ran at the product's
    four float64 lanes: 1.75 -> 2.1-2.2 GB/s on one Zen 2 core, [3072 x 3584] from memory.
    The block is a slice so its indices are plainly non-negative: indexed from the row, the
    byte loads were eight single-byte inserts (numba's negative-index wrap). The activations
    are sliced to the block too: indexed from the whole row (``xe0[pb + k]``), LLVM could not
    prove the index non-negative and loaded them with a 512-bit gather per eight lanes on an
    AVX-512 CPU, which on a Zen 4 core took [3072 x 3584] from 1.46 to 6.2 ms (0.94 GB/s).
    """
    for o in prange(packed.shape[0]):
        out0[o] = np.float32(mx_row_t1(packed[o], scales[o], xe0, xo0))


@njit(inline="always", **JIT)
def mx_row_t1(pr, sr, xe0, xo0):
    """One packed MXFP4 row ``pr`` (scale bytes ``sr``) against one token's even and odd
    columns: the row's lane sum, folded (float64), as :func:`_mxfp4_t1` and the grouped
    experts (``experts.py``) compute it. Inlined into the caller, so its stack slots are the
    caller's and its lane sums take the caller's ``contract`` flag."""
    groups = sr.shape[0]
    acc_e = carray(stack_f64(16), 16)
    acc_o = carray(stack_f64(16), 16)
    de = carray(stack_f32(128), 128)
    do = carray(stack_f32(128), 128)
    for k in range(HALF):
        acc_e[k] = 0.0
        acc_o[k] = 0.0
    for g0 in range(0, groups, MX_BLOCK):
        pb0 = g0 * HALF
        prefetch(pr, pb0 + AHEAD_MX)
        prefetch(pr, pb0 + AHEAD_MX + 64)
        blk = pr[pb0 : pb0 + MX_BLOCK * HALF]
        xbe = xe0[pb0 : pb0 + MX_BLOCK * HALF]
        xbo = xo0[pb0 : pb0 + MX_BLOCK * HALF]
        for i in range(blk.shape[0]):
            de[i] = e2m1_lo_f(blk[i])
            do[i] = e2m1_hi_f(blk[i])
        for gi in range(blk.shape[0] // HALF):
            sc = MX_SCALE[sr[g0 + gi]]
            for k in range(HALF):
                acc_e[k] += xbe[gi * HALF + k] * (np.float64(de[gi * HALF + k]) * sc)
                acc_o[k] += xbo[gi * HALF + k] * (np.float64(do[gi * HALF + k]) * sc)
    return _fold_split(acc_e, acc_o)


def _mxfp4_t4(packed, scales, xe, xo, out):
    """Several tokens, four per pass, two rows per task: each group is decoded once for four
    tokens, and each activation loaded once for both rows.

    ``xe``/``xo`` are float64 ``[T4, cols/2]``, ``T4`` a multiple of 4 (zero padding past
    ``out.shape[0]``, results dropped). A pass keeps one lane half (the even lanes, then the
    odd ones) of two rows by four tokens: eight 16-lane accumulators, the registers a whole
    32-lane pass of one row took, with half the activation loads per multiply-add. One Zen 4
    thread, [672 x 768] x 16 tokens (a prefill's routed expert): 11.6 against 13.0 GMAC/s
    for one row a task. With an odd row count the last task computes the last row twice and
    writes the same bits twice.
    """
    rows = packed.shape[0]
    groups = scales.shape[1]
    T = out.shape[0]
    for task in prange((rows + 1) // 2):
        oa = 2 * task
        ob = min(oa + 1, rows - 1)
        ev = carray(stack_f64(128), 128)
        od = carray(stack_f64(128), 128)
        mx_pair_tokens(packed[oa], packed[ob], scales[oa], scales[ob], xe, xo, 0, T, groups,
                       ev, od, out, oa, ob)


@njit(inline="always", **JIT)
def mx_pair_tokens(pa, pb, sa, sb, xe, xo, x0, T, groups, ev, od, out, oa, ob):
    """``out[t, oa]`` and ``out[t, ob]`` for ``t < T``: MXFP4 rows ``pa``/``pb`` (scale
    bytes ``sa``/``sb``) against the tokens at rows ``x0 ..`` of ``xe``/``xo`` (padded to a
    multiple of four), four tokens a pass, the even lanes into ``ev`` and the odd ones into
    ``od`` (``[row * 4 + token][16]``, the caller's stack slots), then folded. Inlined into
    :func:`_mxfp4_t4` and the grouped experts (``experts.py``), so both have these bits and
    the caller's ``contract`` flag."""
    for t0 in range(0, T, 4):
        _mx_half_pass(pa, pb, sa, sb, xe, x0 + t0, groups, False, ev)
        _mx_half_pass(pa, pb, sa, sb, xo, x0 + t0, groups, True, od)
        for t in range(4):
            if t0 + t < T:
                q = t * HALF
                out[t0 + t, oa] = np.float32(_fold_split(ev[q : q + HALF], od[q : q + HALF]))
                q = 4 * HALF + t * HALF
                out[t0 + t, ob] = np.float32(_fold_split(ev[q : q + HALF], od[q : q + HALF]))


@njit(inline="always", **JIT)
def _mx_half_pass(pa, pb, sa, sb, xq, t0, groups, high, acc):
    """``acc[(row * 4 + token) * 16 + k]``: lane ``2k`` (``high`` False: the low nibbles,
    ``xq`` the even columns) or ``2k + 1`` (``high``: the high nibbles, ``xq`` the odd
    columns) of rows ``pa``/``pb`` by tokens ``t0 .. t0 + 3``, from +0.0, columns in
    increasing order. Inlined: ``high`` is a constant at each call, and the stack slots and
    the ``contract`` flag are the caller's."""
    for i in range(8 * HALF):
        acc[i] = 0.0
    x0 = xq[t0]
    x1 = xq[t0 + 1]
    x2 = xq[t0 + 2]
    x3 = xq[t0 + 3]
    for g in range(groups):
        sca = MX_SCALE[sa[g]]
        scb = MX_SCALE[sb[g]]
        c0 = g * HALF
        for k in range(HALF):
            if high:
                va = e2m1_hi_d(pa[c0 + k]) * sca
                vb = e2m1_hi_d(pb[c0 + k]) * scb
            else:
                va = e2m1_lo_d(pa[c0 + k]) * sca
                vb = e2m1_lo_d(pb[c0 + k]) * scb
            a0 = x0[c0 + k]
            a1 = x1[c0 + k]
            a2 = x2[c0 + k]
            a3 = x3[c0 + k]
            acc[0 * HALF + k] += a0 * va
            acc[1 * HALF + k] += a1 * va
            acc[2 * HALF + k] += a2 * va
            acc[3 * HALF + k] += a3 * va
            acc[4 * HALF + k] += a0 * vb
            acc[5 * HALF + k] += a1 * vb
            acc[6 * HALF + k] += a2 * vb
            acc[7 * HALF + k] += a3 * vb


dense_t1 = twins(_dense_t1, **LANE_SUM)
bf16_t1_pairs = twins(_bf16_t1_pairs, **LANE_SUM)
dense_t4 = twins(_dense_t4, **LANE_SUM)
mxfp4_t1 = twins(_mxfp4_t1, **LANE_SUM)
mxfp4_t4 = twins(_mxfp4_t4, **LANE_SUM)
