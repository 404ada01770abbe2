"""The per-channel and per-head recurrences: short convolution and the KDA delta rule.

Both carry state across tokens, so each task walks the tokens in order for its own
channels (shortconv) or its own head (KDA); channels and heads are independent outputs and
are split across threads. The state arrays are updated in place.
"""

from __future__ import annotations

import numpy as np
from k3_backends.numba_kernels.exact import LANES, fold_rows, silu_f
from k3_backends.numba_kernels.jit import JIT, twins
from numba import njit, prange

#: Channels per parallel task in ``shortconv_channels``.
CHANNEL_BLOCK = 256


@njit(**JIT)
def shortconv_channels(x, w, hist, out):
    """Per channel, float32: ``acc = w[K-1]*x_t``; ``acc = acc + w[j]*hist[j]`` (j = 0..K-2);
    shift ``hist`` left, append ``x_t``; ``out = silu(acc)``."""
    T, C = x.shape
    K = w.shape[1]
    for blk in range((C + CHANNEL_BLOCK - 1) // CHANNEL_BLOCK):
        for c in range(blk * CHANNEL_BLOCK, min(C, (blk + 1) * CHANNEL_BLOCK)):
            for t in range(T):
                xt = x[t, c]
                acc = w[c, K - 1] * xt
                for j in range(K - 1):
                    acc = acc + w[c, j] * hist[c, j]
                if K > 1:
                    for j in range(K - 2):
                        hist[c, j] = hist[c, j + 1]
                    hist[c, K - 2] = xt
                out[t, c] = silu_f(acc)


@njit(**JIT)
def _lane_matvec(vec, S, acc, D, res):
    """``res[j] = f32(lsum_i d(vec[i]) * d(S[i, j]))`` (lane = i % LANES), ``acc`` scratch."""
    acc[:, :] = 0.0
    for i in range(D):
        vi = np.float64(vec[i])
        lane = i % LANES
        for j in range(D):
            acc[lane, j] += vi * np.float64(S[i, j])
    fold_rows(acc, D, min(D, LANES))
    for j in range(D):
        res[j] = np.float32(acc[0, j])


@njit(**JIT)
def _kda_head(h, q, k, v, alpha, beta, S, out):
    T, H, D = q.shape
    acc = np.zeros((LANES, D))
    u = np.empty(D, dtype=np.float32)
    wv = np.empty(D, dtype=np.float32)
    Sh = S[h]
    for t in range(T):
        for i in range(D):
            a = alpha[t, h, i]
            for j in range(D):
                Sh[i, j] = a * Sh[i, j]
        _lane_matvec(k[t, h], Sh, acc, D, u)
        bt = beta[t, h]
        for j in range(D):
            wv[j] = bt * (v[t, h, j] - u[j])
        for i in range(D):
            ki = k[t, h, i]
            for j in range(D):
                Sh[i, j] = Sh[i, j] + ki * wv[j]
        _lane_matvec(q[t, h], Sh, acc, D, out[t, h])


def _kda_heads(q, k, v, alpha, beta, S, out):
    """The delta rule per head h, token by token (float32 unless stated):
    ``S[i,:] = alpha[i]*S[i,:]``; ``u = f32(lsum_i d(k[i]) d(S[i,:]))``;
    ``w = beta*(v - u)``; ``S[i,j] = S[i,j] + k[i]*w[j]``; ``o = f32(lsum_i d(q[i]) d(S[i,:]))``.
    """
    for h in prange(q.shape[1]):
        _kda_head(h, q, k, v, alpha, beta, S, out)


kda_heads = twins(_kda_heads)
