"""The ``numpy`` kernel backend: the reference every other backend must match bit for bit.

It implements :class:`k3core.api.kernels.KernelBackend` exactly as the contract in that module
states, with the primitives of :mod:`k3_backends.exact_numpy`. Clarity over speed; it is
still fast enough for the synthetic models the tests use.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from k3_backends.exact_numpy import (
    bf16_to_f32,
    d,
    exp_d,
    f32,
    fold_lanes,
    lsum,
    mxfp4_to_f64,
    sig_d,
    tanh_d,
)

from k3.plugin import F32, U16, KernelBackend, KernelBackendSpec, Mxfp4, hookimpl, latent_shapes
from k3.plugin import contract as C

_ROW_BLOCK_BYTES = 8 << 20  # float64 bytes of weights widened at once


def _matmul_rows(rows: int, cols: int, block: Callable[[int, int], np.ndarray], x: F32) -> F32:
    """``y[t, o] = f32(lsum_i(W[o, i] * x[t, i]))`` with W supplied in float64 row blocks."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"matmul: x has shape {x.shape}, weight has {cols} columns")
    T = x.shape[0]
    chunks = -(-cols // C.LANES)
    width = chunks * C.LANES
    xd = np.zeros((T, width), dtype=np.float64)
    xd[:, :cols] = x
    xd = xd.reshape(T, chunks, C.LANES)
    out = np.empty((T, rows), dtype=np.float32)
    rb = max(1, _ROW_BLOCK_BYTES // (8 * width))
    for r0 in range(0, rows, rb):
        r1 = min(rows, r0 + rb)
        wb = np.zeros((r1 - r0, width), dtype=np.float64)
        wb[:, :cols] = block(r0, r1)
        wb = wb.reshape(r1 - r0, chunks, C.LANES)
        acc = np.zeros((T, r1 - r0, C.LANES), dtype=np.float64)
        for c in range(chunks):
            acc += xd[:, None, c, :] * wb[None, :, c, :]
        out[:, r0:r1] = f32(fold_lanes(acc))
    return out


def _softmax(scores: F32, axis: int) -> F32:
    """The contract's softmax along ``axis`` (max-subtracted, lane-summed denominator)."""
    m = np.max(scores, axis=axis, keepdims=True)
    e = exp_d(d(scores) - d(m))
    z = np.expand_dims(lsum(e, axis=axis), axis)
    return f32(e / z)


class NumpyBackend(KernelBackend):
    """The reference implementation of the kernel contract."""

    name = "numpy"
    #: the contract's float64 ``exp``, unrounded (every transcendental op is built on it):
    #: k3.testing's adversarial inputs are chosen where it differs from a correctly
    #: rounded exp
    exp_d = staticmethod(exp_d)

    def __init__(self, threads: int = 1) -> None:
        self._threads = 1

    # --- matrix products ---------------------------------------------------------------
    def matmul_bf16(self, w: U16, x: F32) -> F32:
        return _matmul_rows(w.shape[0], w.shape[1], lambda a, b: bf16_to_f32(w[a:b]), x)

    def matmul_f32(self, w: F32, x: F32) -> F32:
        return _matmul_rows(w.shape[0], w.shape[1], lambda a, b: w[a:b], x)

    def matmul_mxfp4(self, w: Mxfp4, x: F32) -> F32:
        rows, cols = w.shape
        return _matmul_rows(
            rows, cols, lambda a, b: mxfp4_to_f64(w.packed[a:b], w.scales[a:b]), x
        )

    # --- normalisation and activations ---------------------------------------------------
    def rmsnorm(self, x: F32, w: F32 | None, eps: float) -> F32:
        xd = d(x)
        inv = f32(1.0 / np.sqrt(lsum(xd * xd) / x.shape[-1] + eps))
        y = x * inv[..., None]
        return y if w is None else y * w

    def l2norm(self, x: F32) -> F32:
        xd = d(x)
        inv = f32(1.0 / np.sqrt(lsum(xd * xd) + C.L2_EPS))
        return x * inv[..., None]

    def sigmoid(self, x: F32) -> F32:
        return f32(sig_d(d(x)))

    def silu(self, x: F32) -> F32:
        xd = d(x)
        return f32(xd * sig_d(xd))

    def exp(self, x: F32) -> F32:
        return f32(exp_d(d(x)))

    def situ_glu(self, g: F32, u: F32, b1: float, b2: float) -> F32:
        gd, ud = d(g), d(u)
        a = b1 * tanh_d(gd / b1) * sig_d(gd)
        c = b2 * tanh_d(ud / b2)
        return f32(a * c)

    # --- attention building blocks ---------------------------------------------------------
    def shortconv(self, x: F32, w: F32, hist: F32) -> F32:
        T, _ = x.shape
        K = w.shape[1]
        y = np.empty_like(x)
        for t in range(T):
            acc = w[:, K - 1] * x[t]
            for j in range(K - 1):
                acc = acc + w[:, j] * hist[:, j]
            if K > 1:
                hist[:, :-1] = hist[:, 1:]
                hist[:, -1] = x[t]
            y[t] = self.silu(acc)
        return y

    def kda_gate(self, z: F32, dt_bias: F32, a_log: F32, lower_bound: float) -> F32:
        H = a_log.shape[0]
        D = z.shape[-1] // H
        a = np.repeat(exp_d(d(a_log)), D)
        u = a * (d(z) + d(dt_bias))
        return f32(exp_d(lower_bound * sig_d(u)))

    def kda_recurrent(self, q: F32, k: F32, v: F32, alpha: F32, beta: F32, state: F32) -> F32:
        T = q.shape[0]
        out = np.empty_like(v)
        for t in range(T):
            state *= alpha[t][:, :, None]
            u = f32(lsum(d(k[t])[:, :, None] * d(state), axis=1))
            w = beta[t][:, None] * (v[t] - u)
            state += k[t][:, :, None] * w[:, None, :]
            out[t] = f32(lsum(d(q[t])[:, :, None] * d(state), axis=1))
        return out

    def mla_attention(
        self, q: F32, k_nope: F32, k_rope: F32, v: F32, pos0: int, scale: float
    ) -> F32:
        T, H, _ = q.shape
        out = np.empty((T, H, v.shape[2]), dtype=np.float32)
        for t in range(T):
            n = pos0 + t + 1
            rope = np.broadcast_to(k_rope[:n, None, :], (n, H, k_rope.shape[1]))
            keys = np.concatenate([k_nope[:n], rope], axis=-1)  # [n, H, n+r]
            score = f32(lsum(d(q[t])[None] * d(keys)) * scale)  # [n, H]
            p = _softmax(score, axis=0)
            out[t] = f32(lsum(d(p)[:, :, None] * d(v[:n]), axis=0))
        return out

    def mla_latent_attention(
        self, q: F32, cache: F32, w_kvb: U16 | F32, pos0: int, scale: float
    ) -> F32:
        T, H, n, Cl, r, dv = latent_shapes(q, cache, w_kvb, pos0)
        w = bf16_to_f32(w_kvb) if w_kvb.dtype == np.uint16 else w_kvb
        wd = d(w).reshape(H, n + dv, Cl)
        wk, wv = wd[:, :n, :], wd[:, n:, :]  # [H, n, C], [H, dv, C]
        out = np.empty((T, H, dv), dtype=np.float32)
        for t in range(T):
            N = pos0 + t + 1
            rows = d(cache[:N])  # [N, C+r]
            q_lat = f32(lsum(d(q[t, :, :n])[:, :, None] * wk, axis=1))  # [H, C]
            qq = np.concatenate([q_lat, q[t, :, n:]], axis=-1)  # [H, C+r]
            # heads in blocks, so the float64 products stay near _ROW_BLOCK_BYTES
            hb = max(1, _ROW_BLOCK_BYTES // (8 * N * (Cl + r)))
            for h0 in range(0, H, hb):
                hs = slice(h0, min(H, h0 + hb))
                score = f32(lsum(d(qq[hs])[None] * rows[:, None, :]) * scale)  # [N, hb]
                p = _softmax(score, axis=0)
                o_lat = f32(lsum(d(p)[:, :, None] * rows[:, None, :Cl], axis=0))  # [hb, C]
                out[t, hs] = f32(lsum(wv[hs] * d(o_lat)[:, None, :]))  # [hb, dv]
        return out

    def attn_res(self, sources: F32, fold: F32, eps: float) -> F32:
        keys = self.rmsnorm(sources, None, eps)  # [S, T, E]
        score = f32(lsum(d(keys) * d(fold)))  # [S, T]
        p = _softmax(score, axis=0)
        return f32(lsum(d(p)[:, :, None] * d(sources), axis=0))

    def router(
        self, logits: F32, bias: F32, k: int, renorm: bool, scale: float
    ) -> tuple[np.ndarray, F32]:
        s = self.sigmoid(logits)
        c = s + bias
        idx = np.argsort(-c, axis=-1, kind="stable")[:, :k].astype(np.int64)
        w = np.take_along_axis(s, idx, axis=-1)
        if k > 1 and renorm:
            wd = d(w)
            w = f32(wd / (lsum(wd)[:, None] + C.ROUTER_EPS))
        return idx, w * np.float32(scale)


def _available():  # the reference runs everywhere
    from k3.plugin import Availability

    return Availability.yes()


@hookimpl
def k3_kernel_backends() -> list[KernelBackendSpec]:
    return [
        KernelBackendSpec(
            name="numpy",
            factory="k3_backends.numpy_backend:NumpyBackend",
            description="NumPy reference: defines the bits every backend must match",
            priority=0,
            probe=_available,
        )
    ]
