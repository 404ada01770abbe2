"""Top-k expert selection per token.

``s = f32(sig_d(logits))``; ``c = s + bias`` (float32); pick ``k`` by repeated maximum of
``c``: the largest first, ties to the lowest index, NaN below every number (the order of the
reference's stable ``argsort(-c)``). Weights are the unbiased ``s`` of the picks, optionally
renormalised by their lane sum, then multiplied by ``f32(scale)``.
"""

from __future__ import annotations

import numpy as np
from k3_backends.numba_kernels.exact import LANES, ROUTER_EPS, fold, sig_d
from k3_backends.numba_kernels.jit import JIT
from numba import njit


@njit(**JIT)
def _beats(a, b):
    """True when candidate score ``a`` ranks strictly above ``b`` (NaN ranks last)."""
    if a != a:
        return False
    if b != b:
        return True
    return a > b


@njit(**JIT)
def route_tokens(logits, bias, k, renorm, scale32, idx, w):
    """Fill ``idx[T, kk]`` (int64) and ``w[T, kk]`` (float32), ``kk = min(k, N)``."""
    T, N = logits.shape
    kk = idx.shape[1]
    for t in range(T):
        s = np.empty(N, dtype=np.float32)
        c = np.empty(N, dtype=np.float32)
        taken = np.zeros(N, dtype=np.bool_)
        for j in range(N):
            s[j] = np.float32(sig_d(np.float64(logits[t, j])))
            c[j] = s[j] + bias[j]
        for slot in range(kk):
            best = -1
            for j in range(N):
                if taken[j]:
                    continue
                if best < 0 or _beats(c[j], c[best]):
                    best = j
            taken[best] = True
            idx[t, slot] = best
            w[t, slot] = s[best]
        if k > 1 and renorm:
            lanes = np.zeros(LANES)
            for slot in range(kk):
                lanes[slot % LANES] += np.float64(w[t, slot])
            z = fold(lanes) + ROUTER_EPS
            for slot in range(kk):
                w[t, slot] = np.float32(np.float64(w[t, slot]) / z)
        for slot in range(kk):
            w[t, slot] = w[t, slot] * scale32
