"""The avx2 backend returns the numpy reference's bytes for every op, at 1 and 2 threads.

Awkward sizes (1, 3, 31, 33, 4097), the real Kimi K3 widths, edge values (signed zeros,
subnormals, float32 extremes, infinities, quiet and signalling NaNs with payloads) and the
13-layer oracle's whole-model logits. Skipped only on a CPU without AVX2/FMA; on a capable
CPU a missing compiled module is a failure (the install is broken), not a skip.

NaN payloads: where two different NaNs meet in one operation, NumPy's own surviving
payload depends on its SIMD path (the array length), so the contract cannot fix it; those
cases are compared NaN-for-NaN (same positions, every other byte identical). Every case
with at most one NaN source per output is compared byte for byte.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from k3_backends import avx2_probe

from k3core.api.errors import PluginError
from k3core.api.kernels import Mxfp4
from k3core.testing.kernel_conformance import KernelConformance

pytestmark = pytest.mark.skipif(
    not avx2_probe.check_cpu().ok, reason=f"avx2 backend cannot run here: {avx2_probe.check_cpu().reason}"
)

F32 = np.float32
EDGE = np.concatenate(
    [
        np.array(
            [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38, 3.4028235e38,
             -3.4028235e38, np.inf, -np.inf, 88.7, -103.9, 1e20, -1e20, 0.5, -0.5, 22.0, -22.0,
             44.0, -44.0, 709.0, -708.0, 710.0, -709.0, 1.0, -1.0, 1e-7, -1e-7, 0.25, 7.5],
            dtype=F32,
        ),
        np.array([0x7FC00000, 0xFFC00000, 0x7FC00123, 0xFFC00456, 0x7F800001, 0xFF800002],
                 dtype=np.uint32).view(F32),
    ]
)
NAN_EDGE = EDGE[np.isnan(EDGE)]
FINITE_EDGE = EDGE[np.isfinite(EDGE)]


@pytest.fixture(scope="module", params=[1, 2], ids=["threads1", "threads2"])
def avx2(request):
    from k3_backends.avx2_backend import Avx2Backend

    return Avx2Backend(threads=request.param)


@pytest.fixture
def ref(numpy_backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reference's inf/NaN warnings
        yield numpy_backend


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def same(got, want, *, nan_payload: bool = True) -> None:
    """Byte equality (or NaN-for-NaN equality when ``nan_payload`` is False)."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            same(g, w, nan_payload=nan_payload)
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    gb, wb = _bits(got).reshape(-1), _bits(want).reshape(-1)
    diff = gb != wb
    if not nan_payload and got.dtype.kind == "f":
        gn, wn = np.isnan(got).reshape(-1), np.isnan(want).reshape(-1)
        assert np.array_equal(gn, wn), "NaN positions differ"
        diff &= ~gn
    bad = np.nonzero(diff)[0]
    assert bad.size == 0, f"{bad.size} elements differ, first at {bad[:5].tolist()}: " + ", ".join(
        f"{int(gb[i]):#x} != {int(wb[i]):#x}" for i in bad[:5]
    )


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def bf16(rng, rows, cols):
    """bf16 bit patterns from random floats, with zeros and subnormals mixed in."""
    w = rng.standard_normal((rows, cols)).astype(F32) * F32(rng.choice([1e-3, 1.0, 30.0]))
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    bits.reshape(-1)[:: 17] = 0
    bits.reshape(-1)[5 :: 29] = 0x0003  # subnormal bf16
    bits.reshape(-1)[7 :: 31] = 0x8000  # -0.0
    return bits


# the last sizes are large enough (rows * cols * T >= 2**21) to run on several threads
SIZES = [(1, 1, 1), (3, 3, 1), (31, 31, 2), (33, 33, 3), (7, 4097, 1), (5, 4097, 3),
         (37, 1000, 1), (16, 7168, 1), (4, 7168, 2), (3, 3584, 1), (3, 3072, 1),
         (301, 7168, 1), (150, 4097, 5), (3, 7168, 40),  # 40 tokens: several token blocks
         (37, 1000, 13), (21, 1537, 8), (70, 2049, 25),  # span tiles: token and row tails
         (19, 1024, 9), (37, 64, 16), (50, 2048, 8)]  # whole chunks: bf16 rows read in place


# --- matrix products -----------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols,T", SIZES)
def test_matmul_bf16(avx2, ref, rows, cols, T):
    rng = np.random.default_rng(rows * 7919 + cols + T)
    w, x = bf16(rng, rows, cols), rand(rng, T, cols, scale=2.0)
    same(avx2.matmul_bf16(w, x), ref.matmul_bf16(w, x))
    same(avx2.matmul(w, x), ref.matmul(w, x))


@pytest.mark.parametrize("rows,cols,T", SIZES)
def test_matmul_f32(avx2, ref, rows, cols, T):
    rng = np.random.default_rng(rows * 31 + cols + T)
    w, x = rand(rng, rows, cols), rand(rng, T, cols, scale=3.0)
    w.reshape(-1)[::13] = 0.0
    same(avx2.matmul_f32(w, x), ref.matmul_f32(w, x))


MX_SIZES = [(1, 32, 1), (3, 64, 1), (31, 96, 2), (33, 32, 3), (5, 4096, 1), (4, 3584, 1),
            (4, 3072, 2), (2, 3584, 3), (601, 3584, 1), (257, 3072, 3), (3, 3584, 40),
            (45, 3072, 9), (19, 768, 16), (70, 2048, 23)]  # span tiles: token and row tails


def mxfp4(rng, rows, cols):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(100, 140, (rows, cols // 32), dtype=np.uint8)
    flat = scales.reshape(-1)
    special = np.array([0, 1, 2, 127, 252, 253, 254, 255], dtype=np.uint8)
    flat[: min(flat.size, special.size)] = special[: flat.size]
    return Mxfp4(packed, scales)


@pytest.mark.parametrize("rows,cols,T", MX_SIZES)
def test_matmul_mxfp4(avx2, ref, rows, cols, T):
    rng = np.random.default_rng(rows * 131 + cols + T)
    w, x = mxfp4(rng, rows, cols), rand(rng, T, cols, scale=2.0)
    same(avx2.matmul_mxfp4(w, x), ref.matmul_mxfp4(w, x))
    same(avx2.matmul(w, x), ref.matmul(w, x))


def test_matmul_mxfp4_every_scale_byte(avx2, ref):
    rng = np.random.default_rng(5)
    scales = np.arange(256, dtype=np.uint8).reshape(8, 32)
    packed = rng.integers(0, 256, (8, 512), dtype=np.uint8)
    x = rand(rng, 2, 1024, scale=1e3)
    x[0, ::7] = 3.4e38
    x[1, ::5] = 1e-45
    w = Mxfp4(packed, scales)
    same(avx2.matmul_mxfp4(w, x), ref.matmul_mxfp4(w, x))


def test_matmul_mxfp4_released_bytes(avx2, ref, fixtures):
    import json

    f = json.loads((fixtures / "mxfp4.json").read_text())
    packed = np.asarray(f["packed"]["data"], dtype=np.uint8).reshape(f["packed"]["shape"])
    scales = np.asarray(f["scales"]["data"], dtype=np.uint8).reshape(f["scales"]["shape"])
    x = rand(np.random.default_rng(0), 3, packed.shape[1] * 2)
    w = Mxfp4(packed, scales)
    same(avx2.matmul_mxfp4(w, x), ref.matmul_mxfp4(w, x))


def test_matmul_edge_values_in_x(avx2, ref):
    rng = np.random.default_rng(11)
    cols = 70
    x = rand(rng, EDGE.size, cols)
    x[:, 9] = EDGE  # one edge value per row: at most one NaN source per output
    w = rand(rng, 6, cols)
    w[1] = 0.0
    w[2, 9] = 0.0  # inf * 0 in one lane
    same(avx2.matmul_f32(w, x), ref.matmul_f32(w, x))
    wb = (w.view(np.uint32) >> 16).astype(np.uint16)
    same(avx2.matmul_bf16(wb, x), ref.matmul_bf16(wb, x))
    xm = np.concatenate([x, x[:, :58]], axis=1)
    wm = mxfp4(rng, 3, 128)
    same(avx2.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))


def test_matmul_special_weights(avx2, ref):
    rng = np.random.default_rng(12)
    x = rand(rng, 2, 40)
    bits = bf16(rng, 4, 40)
    bits[0, 3] = 0x7F80  # +inf
    bits[1, 4] = 0xFF80  # -inf
    bits[2, 5] = 0x7FC1  # NaN with payload
    bits[3, 6] = 0x7F81  # signalling NaN
    same(avx2.matmul_bf16(bits, x), ref.matmul_bf16(bits, x))
    wf = bits.astype(np.uint32) << 16
    wf = wf.view(F32)
    same(avx2.matmul_f32(wf, x), ref.matmul_f32(wf, x))


@pytest.mark.parametrize("cols", [40, 1000, 4200])
def test_one_token_bf16_rows_with_special_values(avx2, ref, cols):
    """The one-token bf16 rows (unpacked lane order, k3avx2_one512.c): infinities, NaNs,
    subnormals and signed zeros in the weights and the activations, narrow rows and rows
    wider than one block, a column tail, one token at a time."""
    rng = np.random.default_rng(cols)
    bits = bf16(rng, 6, cols)
    bits[0, 3] = 0x7F80  # +inf
    bits[1, cols - 1] = 0xFF80  # -inf in the tail chunk
    bits[2, 5] = 0x7FC1  # NaN with payload
    bits[3, 17] = 0x7F81  # signalling NaN
    bits[4, 30] = 0x8001  # negative subnormal
    for _ in range(3):  # the special weights against finite activations
        x = rand(rng, 1, cols)
        same(avx2.matmul_bf16(bits, x), ref.matmul_bf16(bits, x))
    finite = bf16(rng, 6, cols)
    finite[4, 30] = 0x8001
    for i in range(EDGE.size):  # one edge activation a token: one NaN source at most
        x = rand(rng, 1, cols)
        x[0, (7 * i) % cols] = EDGE[i]
        same(avx2.matmul_bf16(finite, x), ref.matmul_bf16(finite, x))


def test_matmul_accepts_float64_x_like_the_reference(avx2, ref):
    rng = np.random.default_rng(13)
    w, x = bf16(rng, 5, 40), rng.standard_normal((2, 40))
    same(avx2.matmul_bf16(w, x), ref.matmul_bf16(w, x))


# --- normalisation and activations ---------------------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 31, 33, 4097, 7168])
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_norms(avx2, ref, rows, m):
    rng = np.random.default_rng(rows * 100 + m)
    x, g = rand(rng, rows, m, scale=5.0), rand(rng, m)
    same(avx2.rmsnorm(x, g, 1e-5), ref.rmsnorm(x, g, 1e-5))
    same(avx2.rmsnorm(x, None, 1e-6), ref.rmsnorm(x, None, 1e-6))
    same(avx2.l2norm(x), ref.l2norm(x))


def test_norms_any_rank(avx2, ref):
    rng = np.random.default_rng(3)
    x = rand(rng, 2, 3, 128)
    same(avx2.l2norm(x), ref.l2norm(x))
    same(avx2.rmsnorm(x, None, 1e-5), ref.rmsnorm(x, None, 1e-5))
    v = rand(rng, 33)
    g = rand(rng, 33)
    same(avx2.rmsnorm(v, g, 1e-5), ref.rmsnorm(v, g, 1e-5))


def test_norms_edge_values(avx2, ref):
    rng = np.random.default_rng(4)
    x = rand(rng, EDGE.size, 40)
    x[:, 17] = EDGE  # one edge value per row
    g = rand(rng, 40)
    same(avx2.rmsnorm(x, g, 1e-5), ref.rmsnorm(x, g, 1e-5))
    same(avx2.l2norm(x), ref.l2norm(x))
    many = np.stack([np.roll(EDGE, i) for i in range(EDGE.size)])  # several NaNs per row
    same(avx2.rmsnorm(many, None, 1e-5), ref.rmsnorm(many, None, 1e-5), nan_payload=False)
    same(avx2.l2norm(many), ref.l2norm(many), nan_payload=False)


@pytest.mark.parametrize("n", [1, 3, 31, 33, 4097, 12288, 40000])
def test_unary(avx2, ref, n):
    rng = np.random.default_rng(n)
    x = rand(rng, n, scale=12.0)
    same(avx2.sigmoid(x), ref.sigmoid(x))
    same(avx2.silu(x), ref.silu(x))
    same(avx2.exp(x), ref.exp(x))
    x3 = rand(rng, 2, 3, n, scale=40.0)
    same(avx2.exp(x3), ref.exp(x3))


def test_unary_edge_values(avx2, ref):
    for x in (EDGE, np.tile(EDGE, 3), EDGE[:5]):
        same(avx2.sigmoid(x), ref.sigmoid(x))
        same(avx2.exp(x), ref.exp(x))
        finite = x[~np.isnan(x)]
        same(avx2.silu(finite), ref.silu(finite))
        # silu(NaN) multiplies two NaNs (x and sig_d(x)): payload not fixed by the contract
        same(avx2.silu(x), ref.silu(x), nan_payload=False)


def test_exp_range_boundaries(avx2, ref):
    x = np.linspace(-120.0, 100.0, 20001, dtype=F32)
    same(avx2.exp(x), ref.exp(x))
    same(avx2.sigmoid(x), ref.sigmoid(x))
    tiny = np.array([-103.97, -103.28, -87.34, -87.33, 88.72, 88.73, 1e-30, -1e-30], dtype=F32)
    same(avx2.exp(tiny), ref.exp(tiny))


@pytest.mark.parametrize("n", [1, 3, 31, 33, 4097, 40000])
def test_situ_glu(avx2, ref, n):
    rng = np.random.default_rng(n + 1)
    g, u = rand(rng, n, scale=30.0), rand(rng, n, scale=60.0)
    same(avx2.situ_glu(g, u, 4.0, 25.0), ref.situ_glu(g, u, 4.0, 25.0))
    same(avx2.situ_glu(g * F32(0.01), u * F32(0.01), 0.7, 3.0),
         ref.situ_glu(g * F32(0.01), u * F32(0.01), 0.7, 3.0))


def test_situ_glu_edge_values(avx2, ref):
    g, u = (a.ravel().copy() for a in np.meshgrid(EDGE, EDGE))
    one_nan = ~(np.isnan(g) & np.isnan(u))
    same(avx2.situ_glu(g[one_nan], u[one_nan], 4.0, 25.0),
         ref.situ_glu(g[one_nan], u[one_nan], 4.0, 25.0), nan_payload=False)
    fin = ~np.isnan(g) & ~np.isnan(u)
    same(avx2.situ_glu(g[fin], u[fin], 4.0, 25.0), ref.situ_glu(g[fin], u[fin], 4.0, 25.0))
    same(avx2.situ_glu(g, u, 4.0, 25.0), ref.situ_glu(g, u, 4.0, 25.0), nan_payload=False)


# --- attention building blocks -------------------------------------------------------------
@pytest.mark.parametrize("T,C,K", [(1, 1, 1), (1, 3, 2), (3, 33, 4), (5, 31, 3), (2, 4097, 4),
                                   (1, 12288, 4), (3, 12288, 4)])
def test_shortconv(avx2, ref, T, C, K):
    rng = np.random.default_rng(T * 1000 + C + K)
    x, w, h = rand(rng, T, C, scale=3.0), rand(rng, C, K), rand(rng, C, K - 1)
    h2 = h.copy()
    same(avx2.shortconv(x, w, h), ref.shortconv(x, w, h2))
    same(h, h2)
    x2 = rand(rng, 2, C)
    same(avx2.shortconv(x2, w, h), ref.shortconv(x2, w, h2))  # continues from the carried state
    same(h, h2)


def test_shortconv_edge_values(avx2, ref):
    rng = np.random.default_rng(21)
    C = EDGE.size
    x, w, h = rand(rng, 2, C), rand(rng, C, 4), rand(rng, C, 3)
    x[1] = EDGE
    h2 = h.copy()
    same(avx2.shortconv(x, w, h), ref.shortconv(x, w, h2), nan_payload=False)
    same(h, h2)
    xf = rand(rng, 2, FINITE_EDGE.size)
    xf[0] = FINITE_EDGE
    wf, hf = rand(rng, FINITE_EDGE.size, 4), rand(rng, FINITE_EDGE.size, 3)
    hf2 = hf.copy()
    same(avx2.shortconv(xf, wf, hf), ref.shortconv(xf, wf, hf2))


@pytest.mark.parametrize("T,H,D", [(1, 1, 1), (3, 4, 16), (2, 3, 31), (1, 96, 128), (3, 96, 128)])
def test_kda_gate(avx2, ref, T, H, D):
    rng = np.random.default_rng(T + H + D)
    z, dt, a = rand(rng, T, H * D, scale=4.0), rand(rng, H * D), rand(rng, H)
    same(avx2.kda_gate(z, dt, a, -5.0), ref.kda_gate(z, dt, a, -5.0))


def test_kda_gate_edge_values(avx2, ref):
    z = np.stack([EDGE, EDGE[::-1]])
    dt = np.zeros(EDGE.size, dtype=F32)
    a = np.array([0.5, -3.0], dtype=F32)
    same(avx2.kda_gate(z, dt, a, -5.0), ref.kda_gate(z, dt, a, -5.0))


@pytest.mark.parametrize("T,H,Dk,Dv", [(1, 1, 1, 1), (3, 2, 33, 33), (2, 3, 31, 31),
                                        (2, 2, 40, 24), (1, 8, 128, 128), (1, 64, 128, 128),
                                        (3, 3, 16, 130), (5, 2, 128, 128), (2, 3, 96, 21),
                                        (3, 1, 64, 7)])
def test_kda_recurrent(avx2, ref, T, H, Dk, Dv):
    rng = np.random.default_rng(T * 7 + H + Dk + Dv)
    q, k = rand(rng, T, H, Dk), rand(rng, T, H, Dk)
    v = rand(rng, T, H, Dv)
    alpha = rng.uniform(0.5, 1.0, (T, H, Dk)).astype(F32)
    beta = rng.uniform(0.0, 1.0, (T, H)).astype(F32)
    s1 = rand(rng, H, Dk, Dv)
    s2 = s1.copy()
    same(avx2.kda_recurrent(q, k, v, alpha, beta, s1), ref.kda_recurrent(q, k, v, alpha, beta, s2))
    same(s1, s2)


MLA = [  # T, H, n, r, dv, S (= pos0 + T)
    (1, 1, 1, 1, 1, 1),
    (3, 4, 24, 8, 16, 9),
    (2, 3, 50, 13, 7, 40),
    (3, 2, 128, 64, 128, 3),
    (1, 4, 128, 64, 128, 1024),
    (2, 8, 128, 64, 128, 700),  # T * H * positions * (n + r) >= 2**20: several threads
]


@pytest.mark.parametrize("T,H,n,r,dv,S", MLA)
def test_mla_attention(avx2, ref, T, H, n, r, dv, S):
    rng = np.random.default_rng(T + H + n + r + dv + S)
    q = rand(rng, T, H, n + r)
    kn, kr, v = rand(rng, S, H, n), rand(rng, S, r), rand(rng, S, H, dv)
    scale = (n + r) ** -0.5
    same(avx2.mla_attention(q, kn, kr, v, S - T, scale), ref.mla_attention(q, kn, kr, v, S - T, scale))


def test_mla_attention_extreme_scores(avx2, ref):
    rng = np.random.default_rng(8)
    q = rand(rng, 2, 2, 40, scale=30.0)
    kn, kr, v = rand(rng, 6, 2, 32, scale=30.0), rand(rng, 6, 8), rand(rng, 6, 2, 5)
    kn[2, 0, 0] = np.inf
    same(avx2.mla_attention(q, kn, kr, v, 4, 0.5), ref.mla_attention(q, kn, kr, v, 4, 0.5))


@pytest.mark.parametrize("S,T,E", [(1, 1, 1), (2, 3, 31), (9, 3, 129), (40, 2, 300), (5, 1, 7168),
                                   (9, 17, 7168)])
def test_attn_res(avx2, ref, S, T, E):
    rng = np.random.default_rng(S + T + E)
    src, fold = rand(rng, S, T, E, scale=3.0), rand(rng, E)
    same(avx2.attn_res(src, fold, 1e-5), ref.attn_res(src, fold, 1e-5))


@pytest.mark.parametrize("T,N,k", [(1, 1, 1), (3, 8, 2), (2, 33, 5), (6, 896, 16), (2, 8, 9),
                                   (40, 896, 16)])
@pytest.mark.parametrize("renorm", [True, False])
def test_router(avx2, ref, T, N, k, renorm):
    rng = np.random.default_rng(T * N + k)
    logits, bias = rand(rng, T, N, scale=3.0), rand(rng, N, scale=0.1)
    same(avx2.router(logits, bias, k, renorm, 2.5), ref.router(logits, bias, k, renorm, 2.5))


def test_router_ties_and_edges(avx2, ref):
    logits = np.zeros((3, 40), dtype=F32)  # all tied: lowest indices first
    bias = np.zeros(40, dtype=F32)
    same(avx2.router(logits, bias, 8, True, 1.0), ref.router(logits, bias, 8, True, 1.0))
    edge = np.stack([np.roll(EDGE, i) for i in range(4)])
    b = np.resize(FINITE_EDGE, EDGE.size).astype(F32) * F32(1e-3)
    for k in (1, 8, EDGE.size, EDGE.size + 3, 0):
        same(avx2.router(edge, b, k, True, 2.5), ref.router(edge, b, k, True, 2.5))


# --- thread counts and the GIL -------------------------------------------------------------
def test_thread_counts_agree(ref):
    from k3_backends.avx2_backend import Avx2Backend

    rng = np.random.default_rng(99)
    w, x = bf16(rng, 101, 777), rand(rng, 3, 777)
    want = ref.matmul_bf16(w, x)
    for n in (1, 2, 3, 7):
        b = Avx2Backend(threads=n)
        assert b.threads == n
        same(b.matmul_bf16(w, x), want)


def test_gil_is_released():
    """Two Python threads are inside one C call at the same moment (only possible without
    the GIL): each checks in and waits for the other."""
    mod = avx2_probe.load_module()
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(mod.lib.k3_gil_rendezvous(2, 10.0)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1, 1]


def test_the_module_brings_no_openmp_runtime(tmp_path):
    """Every parallel loop runs on the module's own pool: loading it, first in a fresh
    process, maps no OpenMP runtime (whose idle workers would spin on the pool's cores, for
    as long as whichever library loaded it first had set)."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps")
    code = (
        "import k3_backends._k3avx2 as m\n"
        "m.lib.k3_set_threads(2); m.lib.k3_set_force_parallel(1)\n"
        "x = m.ffi.new('float[]', [0.5] * 4096); y = m.ffi.new('float[]', 4096)\n"
        "m.lib.k3_sigmoid(x, 4096, y); m.lib.k3_rmsnorm(x, 8, 512, m.ffi.NULL, 1e-5, y)\n"
        "assert m.lib.k3_parallel_regions() >= 2\n"
        "maps = open('/proc/self/maps').read()\n"
        "print([ln.split()[-1] for ln in maps.splitlines() if 'gomp' in ln or 'libomp' in ln])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ceiling_probes_run_on_every_thread(threads):
    """The read and FMA probes of the benchmarks start all their threads at once: every
    thread reads its slice (the checksum is the XOR of every word) and runs its chains (the
    sink counts each thread's)."""
    mod = avx2_probe.load_module()
    mod.lib.k3_set_threads(threads)
    try:
        words = np.random.default_rng(3).integers(0, 2**63, 1 << 14, dtype=np.uint64)
        buf = np.empty(words.nbytes + 64, dtype=np.uint8)
        off = (-buf.ctypes.data) % 64
        view = buf[off : off + words.nbytes]
        view[:] = words.view(np.uint8)
        check = mod.ffi.new("uint64_t *")
        for repeat in (1, 3):
            secs = mod.lib.k3_read_bandwidth(mod.ffi.from_buffer(view), view.size, repeat, check)
            assert secs > 0
            assert int(check[0]) == int(np.bitwise_xor.reduce(words))
        sink = mod.ffi.new("double *")
        assert mod.lib.k3_fma_peak(1000, 2, sink) > 0
        one = mod.ffi.new("double *")
        mod.lib.k3_set_threads(1)
        mod.lib.k3_fma_peak(1000, 1, one)
        assert sink[0] == pytest.approx(2 * threads * one[0], rel=1e-12)
    finally:
        mod.lib.k3_set_threads(1)


def test_default_threads_from_environment(monkeypatch):
    from k3_backends.avx2_backend import Avx2Backend, default_threads

    monkeypatch.delenv("K3_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")
    assert default_threads() == 3
    monkeypatch.setenv("K3_THREADS", "2")
    assert Avx2Backend().threads == 2
    monkeypatch.setenv("K3_THREADS", "many")
    with pytest.raises(PluginError, match="K3_THREADS='many' is not a positive thread count"):
        Avx2Backend()


# --- refusals --------------------------------------------------------------------------------
def test_bad_inputs_are_refused(avx2):
    x = np.ones((2, 8), dtype=F32)
    with pytest.raises(ValueError, match="x has shape"):
        avx2.matmul_f32(np.ones((3, 9), dtype=F32), x)
    with pytest.raises(TypeError, match="uint16"):
        avx2.matmul_bf16(np.ones((3, 8), dtype=np.int32), x)
    with pytest.raises(TypeError, match="x must be a float32 array"):
        avx2.rmsnorm(x.astype(np.float64), None, 1e-5)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        avx2.matmul_mxfp4(Mxfp4(np.zeros((2, 8), np.uint8), np.zeros((2, 1), np.uint8)), x)
    with pytest.raises(ValueError, match="updated in place"):
        avx2.shortconv(x, np.ones((8, 3), F32), np.ones((3, 8), F32).T)
    with pytest.raises(ValueError, match="cached positions"):
        q = np.ones((2, 1, 4), F32)
        avx2.mla_attention(q, np.ones((1, 1, 2), F32), np.ones((1, 2), F32),
                           np.ones((1, 1, 2), F32), 0, 1.0)
    with pytest.raises(ValueError, match="thread count"):
        avx2.set_threads(0)


def test_empty_inputs(avx2, ref):
    x = np.zeros((0, 8), dtype=F32)
    w = np.ones((3, 8), dtype=F32)
    same(avx2.matmul_f32(w, x), ref.matmul_f32(w, x))
    same(avx2.sigmoid(np.zeros(0, F32)), ref.sigmoid(np.zeros(0, F32)))


# --- the whole model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle(fixtures):
    from k3core.testing.oracle import load_oracle

    return load_oracle(fixtures)


def _model(cfg, reader, backend):
    from k3core.api.experts import InMemoryExperts
    from k3core.model.forward import Model
    from k3core.model.sources import ModelTables, ResidentTrunk, expert_from_reader

    return Model(
        cfg,
        backend,
        ResidentTrunk(cfg, reader, cfg.n_layers),
        ModelTables(cfg, reader),
        InMemoryExperts(lambda L, e: expert_from_reader(cfg, reader, L, e)),
    )


@pytest.fixture(scope="module")
def oracle_numpy_logits(oracle):
    from k3_backends.numpy_backend import NumpyBackend

    from k3core.model.state import SequenceState

    cfg, reader, ref_json = oracle
    model = _model(cfg, reader, NumpyBackend())
    full = np.array(ref_json["full_ids"])
    return model.forward(full, SequenceState(cfg, len(full)), all_logits=True)


def test_oracle_logits_bitwise(avx2, oracle, oracle_numpy_logits):
    from k3core.model.state import SequenceState

    cfg, reader, ref_json = oracle
    model = _model(cfg, reader, avx2)
    full = np.array(ref_json["full_ids"])
    logits = model.forward(full, SequenceState(cfg, len(full)), all_logits=True)
    same(logits, oracle_numpy_logits)
    assert logits.argmax(-1).tolist() == ref_json["tf_pred"]


def test_oracle_greedy_incremental(avx2, oracle):
    from k3core.run.generate import generate

    cfg, reader, ref_json = oracle
    run = generate(_model(cfg, reader, avx2), ref_json["prompt_ids"], 20, incremental=True)
    assert run.full_ids == ref_json["full_ids"]


def test_read_only_and_strided_inputs(avx2, ref):
    rng = np.random.default_rng(77)
    w = bf16(rng, 40, 130)
    w.setflags(write=False)  # weights mapped read-only from a checkpoint
    x = rand(rng, 6, 260)[:, ::2]  # a strided view
    same(avx2.matmul_bf16(w, x), ref.matmul_bf16(w, x))
    big = rand(rng, 4, 3, 50)
    view = big[:, 1, :]  # not contiguous
    same(avx2.rmsnorm(view, None, 1e-5), ref.rmsnorm(view, None, 1e-5))
    same(avx2.sigmoid(big.transpose(2, 0, 1)), ref.sigmoid(big.transpose(2, 0, 1)))
    wm = mxfp4(rng, 8, 64)
    wm.packed.setflags(write=False)
    xm = rand(rng, 1, 64)
    same(avx2.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))


class TestEveryKernelSplitAcrossThreads(KernelConformance):
    """The conformance suite with every parallel region forced at three threads, so even the
    small test shapes are divided between threads (by default they would run on one)."""

    @pytest.fixture
    def backend(self):
        from k3_backends.avx2_backend import Avx2Backend

        return Avx2Backend(threads=3, force_parallel=True)

    @pytest.fixture
    def kb(self, backend):  # one thread count (three) instead of the base class's 1 and 2
        backend.set_threads(3)
        return backend


@pytest.mark.parametrize("T", [2, 3, 4, 5, 9])
@pytest.mark.parametrize("cols", [1, 31, 33, 64, 1000])
def test_multi_token_kernels_on_both_instruction_sets(ref, T, cols):
    """The AVX-512 multi-token kernels (one decode per chunk for four tokens) and the AVX2
    per-token loop give the reference's bits for every token count and awkward widths."""
    from k3_backends.avx2_backend import Avx2Backend

    rng = np.random.default_rng(T * 1000 + cols)
    b = Avx2Backend(threads=2, force_parallel=True)
    w16, wf = bf16(rng, 7, cols), rand(rng, 7, cols)
    x = rand(rng, T, cols)
    wm = mxfp4(rng, 7, 32 * (1 + cols // 32))
    xm = rand(rng, T, wm.shape[1])
    has = b._lib.k3_use_avx512(1)
    try:
        for on in sorted({0, has}):
            assert b._lib.k3_use_avx512(on) == on
            same(b.matmul_bf16(w16, x), ref.matmul_bf16(w16, x))
            same(b.matmul_f32(wf, x), ref.matmul_f32(wf, x))
            same(b.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))
    finally:
        b._lib.k3_use_avx512(1)


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """The instruction set the kernels take (k3_use_avx512): the AVX-512 paths where the CPU
    has them, and the AVX2 paths on every CPU."""
    from k3_backends.avx2_backend import Avx2Backend

    lib = Avx2Backend(threads=1)._lib
    has = lib.k3_use_avx512(1)
    if request.param == "avx512" and not has:
        pytest.skip("no AVX-512 on this CPU")
    lib.k3_use_avx512(1 if request.param == "avx512" else 0)
    try:
        yield request.param
    finally:
        lib.k3_use_avx512(1)


@pytest.mark.parametrize("threads,forced", [(1, False), (2, True), (3, True)])
@pytest.mark.parametrize("rows,T", [(4, 5), (9, 11), (16, 23), (13, 40)])
def test_lane_pass_tiles_give_the_reference_bits(ref, isa, threads, forced, rows, T):
    """The lane-pass tiles - AVX-512: 4 rows x 5 tokens, one register per row and token, the
    four lane registers computed one pass after another; AVX2: 4 rows x 3 tokens, eight
    passes over float32 copies of 512-column blocks, tokens in groups of 12 - for bf16 rows
    ending inside a step or a block, MXFP4 with special scales, the SiTU MLP and grouped
    experts, serial and split between threads (forced chunks are one tile of rows), with token
    and row counts that leave tails."""
    from k3_backends.avx2_backend import Avx2Backend

    b = Avx2Backend(threads=threads, force_parallel=forced)
    rng = np.random.default_rng(rows * 100 + T)
    for cols in (1, 7, 8, 9, 31, 40, 1003):
        w, x = bf16(rng, rows, cols), rand(rng, T, cols, scale=2.0)
        x.reshape(-1)[::37] = np.inf if cols == 9 else 0.0
        same(b.matmul_bf16(w, x), ref.matmul_bf16(w, x))
    for cols in (32, 96, 1024):
        wm, xm = mxfp4(rng, rows, cols), rand(rng, T, cols, scale=2.0)
        same(b.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))
    inter, cols = 4 * rows, 64
    w1, w3, w2 = bf16(rng, inter, cols), bf16(rng, inter, cols), bf16(rng, cols, inter)
    xs = rand(rng, T, cols)
    same(b.situ_mlp(w1, w3, w2, xs, 4.0, 25.0), ref.situ_mlp(w1, w3, w2, xs, 4.0, 25.0))
    mlps = [(mxfp4(rng, 64, 96), mxfp4(rng, 64, 96), mxfp4(rng, 96, 64)) for _ in range(3)]
    ins = [rand(rng, n, 96) for n in (T, 1, T + 2)]
    for got, want in zip(b.situ_mlp_many(mlps, ins, 4.0, 25.0),
                         ref.situ_mlp_many(mlps, ins, 4.0, 25.0), strict=True):
        same(got, want)


@pytest.mark.parametrize("threads,forced", [(1, False), (2, True)])
def test_mxfp4_decoded_row_tiles_give_the_reference_bits(ref, isa, threads, forced):
    """MXFP4 row tiles decoded once into a float32 copy read by every token tile (eight
    tokens or more; fewer keep the pass tiles): five-token tiles and every count of tokens
    left over (1..4), row tails, special activations, the grouped experts with uneven token
    counts; the extreme scales the copy still takes (0, 1, 2: subnormal float32 weights;
    252: the largest) and the ones that send a tile back to the MXFP4 pass tiles on AVX-512 or
    to one table lookup per weight on AVX2 (253..255)."""
    from k3_backends.avx2_backend import Avx2Backend

    b = Avx2Backend(threads=threads, force_parallel=forced)
    rng = np.random.default_rng(17 + threads)
    for T in range(2, 16):
        for rows, cols in ((8, 64), (13, 96), (4, 736)):
            wm, xm = mxfp4(rng, rows, cols), rand(rng, T, cols, scale=2.0)
            xm.reshape(-1)[::41] = (np.inf, -0.0, np.nan, 3e38)[T % 4]
            same(b.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))
    for edge in ((0, 1, 2, 252), (0, 252, 253), (254, 255, 127)):
        wm = mxfp4(rng, 8, 128)
        wm.scales[:] = rng.choice(np.array(edge, np.uint8), wm.scales.shape)
        xm = rand(rng, 12, 128, scale=2.0)
        same(b.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))
    mlps = [(mxfp4(rng, 64, 96), mxfp4(rng, 64, 96), mxfp4(rng, 96, 64)) for _ in range(6)]
    ins = [rand(rng, n, 96) for n in (2, 9, 11, 13, 17, 24)]
    for got, want in zip(b.situ_mlp_many(mlps, ins, 4.0, 25.0),
                         ref.situ_mlp_many(mlps, ins, 4.0, 25.0), strict=True):
        same(got, want)


def _fused_calls_agree(b, ref, rng, cols, T, inter, ex_rows, ex_cols, ex_tokens) -> None:
    """A group of three bf16 matrices over one input of T tokens, the SiTU MLP over it
    (inter columns), and grouped MXFP4 experts [ex_rows x ex_cols] with ex_tokens tokens each:
    the backend's bits are the reference's."""
    ws = [bf16(rng, r, cols) for r in (33, 16, 7)]
    xs = rand(rng, T, cols)
    for got, want in zip(b.matmul_many(ws, xs), ref.matmul_many(ws, xs), strict=True):
        same(got, want)
    w1, w3, w2 = bf16(rng, 40, inter), bf16(rng, 40, inter), bf16(rng, inter, 40)
    same(b.situ_mlp(w1, w3, w2, xs[:, :inter], 4.0, 25.0),
         ref.situ_mlp(w1, w3, w2, xs[:, :inter], 4.0, 25.0))
    mlps = [(mxfp4(rng, ex_rows, ex_cols), mxfp4(rng, ex_rows, ex_cols),
             mxfp4(rng, ex_cols, ex_rows)) for _ in ex_tokens]
    ins = [rand(rng, n, ex_cols) for n in ex_tokens]
    for got, want in zip(b.situ_mlp_many(mlps, ins, 4.0, 25.0),
                         ref.situ_mlp_many(mlps, ins, 4.0, 25.0), strict=True):
        same(got, want)


@pytest.mark.parametrize("threads,forced", [(1, False), (2, False), (2, True), (3, True)])
def test_one_token_tiles_give_the_reference_bits(ref, isa, threads, forced):
    """One token: AVX-512 tiles of 16 rows, rows wider than 4096 padded columns taken block by
    block (each row's lanes kept between blocks, the next block and the next tile prefetched),
    and the AVX2 rows; row counts around a tile, bf16 and float32 rows ending inside a chunk,
    MXFP4 with special scales, a group of matrices over the same x, the SiTU MLP and grouped
    experts of one token each; serial and split between threads (forced chunks of four
    rows, or unforced in chunks of four tiles)."""
    from k3_backends.avx2_backend import Avx2Backend

    b = Avx2Backend(threads=threads, force_parallel=forced)
    rng = np.random.default_rng(91 + threads)
    for rows in (1, 15, 16, 17, 70):
        for cols in (4096, 4097, 6001, 12290):
            w, x = bf16(rng, rows, cols), rand(rng, 1, cols, scale=2.0)
            x.reshape(-1)[::53] = (0.0, np.inf, -0.0, 3e38)[rows % 4]
            same(b.matmul_bf16(w, x), ref.matmul_bf16(w, x))
            wf = rand(rng, rows, cols, scale=3.0)
            same(b.matmul_f32(wf, x), ref.matmul_f32(wf, x))
        for cols in (4096, 4128, 7168):
            wm, xm = mxfp4(rng, rows, cols), rand(rng, 1, cols, scale=2.0)
            same(b.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))
    # unforced, wide rows go out in chunks of four tiles (64 rows): several chunks, each tile
    # but a chunk's last prefetching the next
    w, x = bf16(rng, 301, 7168), rand(rng, 1, 7168, scale=2.0)
    same(b.matmul_bf16(w, x), ref.matmul_bf16(w, x))
    wm = mxfp4(rng, 301, 7168)
    same(b.matmul_mxfp4(wm, x), ref.matmul_mxfp4(wm, x))
    _fused_calls_agree(b, ref, rng, 5000, 1, 4608, 32, 4160, (1, 1, 1))


@pytest.mark.parametrize("threads,forced", [(1, False), (2, False), (2, True), (3, True)])
def test_span_tiles_give_the_reference_bits(ref, isa, threads, forced):
    """The span tiles (AVX-512: pass-major quarters, eight tokens or more; AVX2: eighth-major
    copies, bf16 and float32 from two tokens, MXFP4 from three, its copy decoded straight to
    float64 in MX_PERM order): spans of 16 (AVX2: 15) rows and their row tails, tiles of
    six (AVX2: four) tokens and every token tail (AVX2: 5, 6 and 9 tokens left in tiles of
    three), rows ending inside a chunk and wider than an eighth block,
    every kind of MXFP4 scale byte (0, 1, 2, 252, and 253..255, past float32's range: the
    AVX-512 tiles' table lookup per weight), token blocks larger than L2
    (AVX2: several blocks of a 7232-column product), a group of matrices, the SiTU MLP and
    grouped experts; serial and split between threads. The AVX-512 tiles read float64 and
    float32 copies of a span's weights alike (k3_use_span_f32; an MXFP4 span with a scale
    byte past 252 always takes the float64 copy)."""
    from k3_backends.avx2_backend import Avx2Backend

    b = Avx2Backend(threads=threads, force_parallel=forced)
    default = b._lib.k3_use_span_f32(-1)  # a query: the choice stays as it is
    try:
        for f32 in ((0, 1) if isa == "avx512" else (default,)):
            assert b._lib.k3_use_span_f32(f32) == f32
            _span_tiles_agree(b, ref, np.random.default_rng(57 + threads + 4 * forced))
    finally:
        b._lib.k3_use_span_f32(default)


def test_span_copies_default_to_float32_on_amd_only():
    """The span tiles' float32 copies are the default where the CPU is AMD's (its widening
    runs beside the FMAs), float64 elsewhere (it shares their port on Intel cores)."""
    from k3_backends.avx2_backend import Avx2Backend

    try:
        with open("/proc/cpuinfo") as f:
            amd = "AuthenticAMD" in f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo to name the CPU's vendor")
    lib = Avx2Backend(threads=1)._lib
    assert lib.k3_use_span_f32(-1) == int(amd)
    assert lib.k3_use_span_f32(-1) == int(amd)  # the query changed nothing


def _span_tiles_agree(b, ref, rng):
    for T in (2, 3, 4, 5, 6, 7, 8, 9, 10, 13):
        for rows, cols in ((1, 1), (4, 31), (16, 33), (17, 1003), (33, 4130)):
            w, x = bf16(rng, rows, cols), rand(rng, T, cols, scale=2.0)
            x.reshape(-1)[::37] = (0.0, np.inf, -0.0, 3e38)[T % 4]
            same(b.matmul_bf16(w, x), ref.matmul_bf16(w, x))
            wf = rand(rng, rows, cols, scale=3.0)
            same(b.matmul_f32(wf, x), ref.matmul_f32(wf, x))
    for T in (3, 4, 5, 9, 10, 11, 12, 16, 23):
        for rows, cols in ((5, 32), (16, 96), (19, 4128)):
            wm, xm = mxfp4(rng, rows, cols), rand(rng, T, cols, scale=2.0)
            same(b.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))
    for edge in ((0, 1, 2, 252), (0, 252, 253), (254, 255, 127)):
        wm = mxfp4(rng, 18, 160)
        wm.scales[:] = rng.choice(np.array(edge, np.uint8), wm.scales.shape)
        for T in (3, 14):
            xm = rand(rng, T, 160, scale=2.0)
            same(b.matmul_mxfp4(wm, xm), ref.matmul_mxfp4(wm, xm))
    w, x = bf16(rng, 5, 7232), rand(rng, 80, 7232)  # AVX2: blocks of 72 tokens, then 8
    same(b.matmul_bf16(w, x), ref.matmul_bf16(w, x))
    _fused_calls_agree(b, ref, rng, 200, 9, 96, 64, 96, (9, 10, 16, 33))


def _specials(rng, n):
    """float32 values of every kind: normal, tiny, huge, +-0, subnormal, +-inf, NaNs."""
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 30.0, 800.0], n)).astype(F32)
    if n == 0:
        return x
    pick = np.array([0.0, -0.0, 1e-45, -1e-40, np.inf, -np.inf, np.nan, 88.0, -104.0, 3e38], F32)
    x[rng.integers(0, n, max(1, n // 7))] = rng.choice(pick, max(1, n // 7))
    x.view(np.uint32)[rng.integers(0, n, max(1, n // 50))] = 0x7FC01234  # a NaN payload
    return x


@pytest.mark.parametrize("threads,forced", [(1, False), (3, True)])
def test_vector_elementwise_and_conv_paths_give_the_reference_bits(ref, isa, threads, forced):
    """sigmoid, silu and exp eight lanes at a time (AVX-512) or four (AVX2), shortconv with
    eight channels in the lanes and kda_gate eight or four elements at a time, against the
    reference on every kind of value, with tails that take the scalar code, and the conv
    history left the same (a NaN compared as a class: its payload is not part of the
    contract)."""
    from k3_backends.avx2_backend import Avx2Backend

    b = Avx2Backend(threads=threads, force_parallel=forced)
    rng = np.random.default_rng(17)
    for n in (1, 7, 8, 9, 255, 256, 1003, 70000):
        x = _specials(rng, n)
        for op in ("sigmoid", "silu", "exp"):
            same(getattr(b, op)(x), getattr(ref, op)(x), nan_payload=False)
    for C, T, K in ((8, 1, 4), (13, 5, 4), (1541, 3, 4), (16, 2, 1), (24, 4, 2), (9, 3, 8), (8, 2, 9)):
        x = _specials(rng, T * C).reshape(T, C)
        w = _specials(rng, C * K).reshape(C, K)
        h0 = _specials(rng, C * (K - 1)).reshape(C, K - 1)
        ha, hr = h0.copy(), h0.copy()
        same(b.shortconv(x, w, ha), ref.shortconv(x, w, hr), nan_payload=False)
        same(ha, hr)
    for H, D, T in ((3, 128, 2), (2, 13, 3), (4, 8, 1)):
        z = _specials(rng, T * H * D).reshape(T, H * D)
        dt = _specials(rng, H * D)
        a_log = (rng.standard_normal(H) * 2).astype(F32)
        same(b.kda_gate(z, dt, a_log, -5.0), ref.kda_gate(z, dt, a_log, -5.0), nan_payload=False)


def test_situ_vector_paths_agree_with_the_scalar_code_on_every_exponent(ref, isa):
    """The vector SiTU (eight lanes on AVX-512, four on AVX2, blended branches) against the
    scalar code on random float32 bit patterns of every exponent (a length of 1 leaves every
    element to the scalar tail), and against the reference on a sample."""
    from k3_backends.avx2_backend import Avx2Backend

    rng = np.random.default_rng(11)
    bits = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    g, u = bits.view(F32), np.roll(bits, 12345).view(F32)
    b = Avx2Backend(threads=1)
    for b1, b2 in ((4.0, 25.0), (0.5, 3.0)):
        vec = b.situ_glu(g, u, b1, b2)
        scalar = np.concatenate([b.situ_glu(g[i:i + 1], u[i:i + 1], b1, b2) for i in range(g.size)])
        same(vec, scalar)
        small = (rng.standard_normal(4099) * 30).astype(F32)
        same(b.situ_glu(small, small[::-1].copy(), b1, b2), ref.situ_glu(small, small[::-1].copy(), b1, b2))


@pytest.mark.parametrize("C,n,r,dv", [(512, 128, 64, 128), (37, 9, 5, 3), (8, 1, 0, 1)])
def test_mla_latent_avx512_and_avx2_paths_agree(ref, C, n, r, dv):
    """The latent attention's AVX-512 lane updates and score dot against its AVX2 code and
    the reference (bf16 and float32 kv_b, forced parallel at two threads)."""
    from k3_backends.avx2_backend import Avx2Backend

    rng = np.random.default_rng(C + n)
    b = Avx2Backend(threads=2, force_parallel=True)
    T, H, pos0 = 3, 2, 4
    q = rand(rng, T * H, n + r).reshape(T, H, n + r)
    cache = rand(rng, pos0 + T + 1, C + r)
    ws = (bf16(rng, H * (n + dv), C) & np.uint16(0xBFFF), rand(rng, H * (n + dv), C))
    has = b._lib.k3_use_avx512(1)
    try:
        for on in sorted({0, has}):
            assert b._lib.k3_use_avx512(on) == on
            for w in ws:
                same(b.mla_latent_attention(q, cache, w, pos0, 0.07),
                     ref.mla_latent_attention(q, cache, w, pos0, 0.07))
    finally:
        b._lib.k3_use_avx512(1)


def test_weight_pointers_are_remembered_per_object_and_forgotten_with_it(avx2, ref):
    """The fused products remember a weight's checks and pointers while the weight object
    lives (the trunk and the cached experts recur every token): the same object again gives
    the same bits, an array reshaped in place is checked again, and the entry goes when the
    object does (its id may then name another weight)."""
    import gc

    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    w = bf16(rng, 6, 64)
    m = mxfp4(rng, 4, 64)
    before = len(avx2._wmemo)
    for _ in range(2):
        got = avx2.matmul_many([w, m, w], x)
        want = [ref.matmul_bf16(w, x), ref.matmul_mxfp4(m, x), ref.matmul_bf16(w, x)]
        for g, r in zip(got, want, strict=True):
            assert np.array_equal(_bits(g), _bits(r))
    assert len(avx2._wmemo) == before + 2
    flat = w.reshape(-1).copy()
    w2 = flat.view()
    w2.shape = (6, 64)
    avx2.matmul_many([w2, w2], x)
    w2.shape = (3, 128)  # the same object, another shape: not the remembered one
    x2 = rng.standard_normal((1, 128)).astype(np.float32)
    got = avx2.matmul_many([w2, w2], x2)
    assert np.array_equal(_bits(got[0]), _bits(ref.matmul_bf16(w2, x2)))
    del w, m, w2, flat, got
    gc.collect()
    assert len(avx2._wmemo) == before
