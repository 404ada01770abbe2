"""Softmax-weighted mixing: MLA attention over the KV cache and the attention residuals.

Each (token, head) of MLA and each token of AttnRes is an independent output, split across
threads. Within one, the contract's order is followed literally: scores by the lane sum,
the max-subtracted ``exp_d`` softmax with a lane-summed float64 denominator, then the
lane-summed mixture (lane = source index % 32), accumulated for a whole output row at once.
"""

from __future__ import annotations

import math

import numpy as np
from k3_backends.numba_kernels.exact import (
    LANES,
    dot_into,
    exp_d,
    fold,
    fold_rows,
    max_nan,
    sumsq_f32,
)
from k3_backends.numba_kernels.jit import JIT, twins
from k3_backends.numba_kernels.matmul import widen
from numba import njit, prange

#: Output columns mixed per pass in ``attn_res_tokens`` (keeps the lane buffer small).
COL_BLOCK = 512


@njit(**JIT)
def softmax_into(score, n, e, lanes, p):
    """``p[:n] = f32(e / Z)`` with ``e = exp_d(d(s) - d(max s))``, ``Z = lsum(e)`` (float64)."""
    m = np.float64(max_nan(score, n))
    lanes[:] = 0.0
    for s in range(n):
        e[s] = exp_d(np.float64(score[s]) - m)
        lanes[s % LANES] += e[s]
    z = fold(lanes)
    for s in range(n):
        p[s] = np.float32(e[s] / z)


def _mla_heads(q, k_nope, k_rope, v, pos0, scale, out):
    """Query ``t`` (position ``pos0 + t``) of head ``h`` attends to keys ``0 .. pos0 + t``.

    ``score[s] = f32(lsum([q_nope|q_rope] * [k_nope[s,h]|k_rope[s]]) * scale)`` over the
    concatenated dims (lanes continue across the boundary); ``o = f32(lsum_s p[s] v[s,h,:])``.
    """
    T, H, nr = q.shape
    n = k_nope.shape[2]
    dv = v.shape[2]
    S = pos0 + T
    for th in prange(T * H):
        t = th // H
        h = th % H
        N = pos0 + t + 1
        lanes = np.empty(LANES)
        score = np.empty(S, dtype=np.float32)
        e = np.empty(S)
        p = np.empty(S, dtype=np.float32)
        acc = np.zeros((LANES, dv))
        qn = q[t, h, :n]
        qr = q[t, h, n:]
        for s in range(N):
            lanes[:] = 0.0
            dot_into(lanes, qn, k_nope[s, h], 0)
            dot_into(lanes, qr, k_rope[s], n)
            score[s] = np.float32(fold(lanes) * scale)
        softmax_into(score, N, e, lanes, p)
        for s in range(N):
            ps = np.float64(p[s])
            lane = s % LANES
            for j in range(dv):
                acc[lane, j] += ps * np.float64(v[s, h, j])
        fold_rows(acc, dv, min(N, LANES))
        for j in range(dv):
            out[t, h, j] = np.float32(acc[0, j])


def _mla_latent_heads(q, cache, w, n, dv, pos0, scale, out):
    """Absorbed MLA over the latent cache, one (token, head) per task (the contract's row).

    ``q_lat = f32(lsum_i q_nope[i] W_k[h][i, :])`` (lane ``i % 32``, a whole row of columns
    at once); ``score[s] = f32(lsum([q_lat|q_rope] * cache[s]) * scale)``; softmax;
    ``o_lat = f32(lsum_s p[s] latent[s, :])``; ``o[j] = f32(lsum_c W_v[h][j, c] o_lat[c])``.
    """
    T, H, _ = q.shape
    C = w.shape[1]
    cr = cache.shape[1]
    S = pos0 + T
    for th in prange(T * H):
        t = th // H
        h = th % H
        N = pos0 + t + 1
        base = h * (n + dv)
        lanes = np.empty(LANES)
        score = np.empty(S, dtype=np.float32)
        e = np.empty(S)
        p = np.empty(S, dtype=np.float32)
        qq = np.empty(cr, dtype=np.float32)
        od = np.empty(C)
        acc = np.zeros((LANES, C))
        for i in range(n):
            qi = np.float64(q[t, h, i])
            row = w[base + i]
            lane = i % LANES
            for c in range(C):
                acc[lane, c] += qi * widen(row[c])
        fold_rows(acc, C, min(n, LANES))
        for c in range(C):
            qq[c] = np.float32(acc[0, c])
        for j in range(cr - C):
            qq[C + j] = q[t, h, n + j]
        for s in range(N):
            lanes[:] = 0.0
            dot_into(lanes, qq, cache[s], 0)
            score[s] = np.float32(fold(lanes) * scale)
        softmax_into(score, N, e, lanes, p)
        acc[:, :] = 0.0
        for s in range(N):
            ps = np.float64(p[s])
            lane = s % LANES
            for c in range(C):
                acc[lane, c] += ps * np.float64(cache[s, c])
        fold_rows(acc, C, min(N, LANES))
        for c in range(C):
            od[c] = np.float64(np.float32(acc[0, c]))
        for j in range(dv):
            row = w[base + n + j]
            lanes[:] = 0.0
            for c0 in range(0, C, LANES):
                for ln in range(min(LANES, C - c0)):
                    lanes[ln] += widen(row[c0 + ln]) * od[c0 + ln]
            out[t, h, j] = np.float32(fold(lanes))


@njit(**JIT)
def attn_res_tokens(src, fold_w, eps, out):
    """Per token: ``key_s = rmsnorm(src[s], eps)``; ``score_s = f32(lsum(d(key_s) d(fold)))``;
    ``p = softmax(score)``; ``out = f32(lsum_s d(p[s]) d(src[s]))`` (raw sources mixed)."""
    S, T, E = src.shape
    for t in range(T):
        lanes = np.empty(LANES)
        score = np.empty(S, dtype=np.float32)
        e = np.empty(S)
        p = np.empty(S, dtype=np.float32)
        for s in range(S):
            x = src[s, t]
            inv = np.float32(1.0 / math.sqrt(sumsq_f32(x, lanes) / E + eps))
            lanes[:] = 0.0
            for i in range(E):
                lanes[i % LANES] += np.float64(x[i] * inv) * np.float64(fold_w[i])
            score[s] = np.float32(fold(lanes))
        softmax_into(score, S, e, lanes, p)
        acc = np.zeros((LANES, COL_BLOCK))
        used = min(S, LANES)
        for c0 in range(0, E, COL_BLOCK):
            width = min(COL_BLOCK, E - c0)
            for ln in range(used):
                for j in range(width):
                    acc[ln, j] = 0.0
            for s in range(S):
                ps = np.float64(p[s])
                lane = s % LANES
                for j in range(width):
                    acc[lane, j] += ps * np.float64(src[s, t, c0 + j])
            fold_rows(acc, width, used)
            for j in range(width):
                out[t, c0 + j] = np.float32(acc[0, j])


mla_heads = twins(_mla_heads)
mla_latent_heads = twins(_mla_latent_heads)
