"""The kernel suite catches what the contract forbids: mutant backends, one broken op each.

Each mutant is the numpy reference with one op rewritten the way a plugin author might
(``np.sum``, one sequential float64 accumulator, float32 accumulation, a library ``exp`` or
``tanh``, a fused multiply-add where the contract rounds twice, 16 or 64 lanes). The shipped
suite's tests for that op must fail, with a message that names the op and the first
differing element; the unbroken reference passes the same tests.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from k3_backends import exact_numpy as X

from k3.plugin import LANES, NumpyBackend
from k3.testing import KernelConformance
from k3core.testing import adversarial

d, f32 = X.d, X.f32


# ---- wrong reductions ---------------------------------------------------------------------
def lanes_sum(terms: np.ndarray, lanes: int) -> np.ndarray:
    """The lane sum with another lane count (the fold in halves as the contract's)."""
    t = np.asarray(terms, dtype=np.float64)
    n = t.shape[-1]
    pad = -n % lanes
    t = np.concatenate([t, np.zeros(t.shape[:-1] + (pad,))], axis=-1)
    acc = np.zeros(t.shape[:-1] + (lanes,))
    for c in range(t.shape[-1] // lanes):
        acc += t[..., c * lanes:(c + 1) * lanes]
    h = lanes // 2
    while h >= 1:
        acc = acc[..., :h] + acc[..., h:2 * h]
        h //= 2
    return acc[..., 0]


def sequential(terms: np.ndarray) -> np.ndarray:
    t = np.asarray(terms, dtype=np.float64)
    acc = np.zeros(t.shape[:-1])
    for i in range(t.shape[-1]):
        acc = acc + t[..., i]
    return acc


def float32_sum(terms: np.ndarray) -> np.ndarray:
    t = np.asarray(terms, dtype=np.float64).astype(np.float32)
    acc = np.zeros(t.shape[:-1], dtype=np.float32)
    for i in range(t.shape[-1]):
        acc = acc + t[..., i]
    return acc.astype(np.float64)


SUMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "np.sum": lambda t: np.sum(t, axis=-1),
    "sequential float64": sequential,
    "float32 accumulation": float32_sum,
    "16 lanes": lambda t: lanes_sum(t, 16),
    "64 lanes": lambda t: lanes_sum(t, 64),
}

# ---- wrong transcendentals -----------------------------------------------------------------
LIB_EXP: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "np.exp": lambda x: np.exp(np.asarray(x, dtype=np.float64)),
    "math.exp": np.vectorize(lambda v: math.exp(v) if v < 709.7 else math.inf, otypes=[float]),
}


def lib_sig(exp: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: 1.0 / (1.0 + exp(-np.asarray(x, dtype=np.float64)))


class Mutant(NumpyBackend):
    """The reference with some ops replaced."""

    name = "mutant"

    def __init__(self, **ops: Callable[..., Any]) -> None:
        super().__init__()
        for op, fn in ops.items():
            setattr(self, op, fn)


def _matmul_f32_with(total: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def matmul_f32(w: np.ndarray, x: np.ndarray) -> np.ndarray:
        return f32(total(d(x)[:, None, :] * d(w)[None, :, :]))
    return matmul_f32


def _matmul_bf16_with(total: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda w, x: _matmul_f32_with(total)(X.bf16_to_f32(w), x)


def _matmul_mxfp4_with(total: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def matmul_mxfp4(w: Any, x: np.ndarray) -> np.ndarray:
        dense = X.mxfp4_to_f64(w.packed, w.scales)
        return f32(total(d(x)[:, None, :] * dense[None, :, :]))
    return matmul_mxfp4


def _rmsnorm_with(total: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        xd = d(x)
        inv = f32(1.0 / np.sqrt(total(xd * xd) / x.shape[-1] + eps))
        y = x * inv[..., None]
        return y if w is None else y * w
    return rmsnorm


def _l2norm_with(total: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def l2norm(x: np.ndarray) -> np.ndarray:
        xd = d(x)
        return x * f32(1.0 / np.sqrt(total(xd * xd) + 1e-6))[..., None]
    return l2norm


def _split_dot(q: np.ndarray, keys: np.ndarray, nope: int) -> np.ndarray:
    """The score as two lane sums, nope dims and rope dims, added (lanes restart at the rope)."""
    t = d(q)[None] * d(keys)
    return X.lsum(t[..., :nope]) + X.lsum(t[..., nope:])


def _mla_with(total: Callable[[np.ndarray], np.ndarray] = X.lsum,
              exp: Callable[[np.ndarray], np.ndarray] = X.exp_d,
              mix: Callable[[np.ndarray], np.ndarray] = X.lsum,
              score_sum: Callable[[np.ndarray], np.ndarray] | None = None,
              split: bool = False) -> Callable[..., np.ndarray]:
    def mla_attention(q, k_nope, k_rope, v, pos0, scale):  # type: ignore[no-untyped-def]
        T, H, _ = q.shape
        out = np.empty((T, H, v.shape[2]), dtype=np.float32)
        for t in range(T):
            n = pos0 + t + 1
            rope = np.broadcast_to(k_rope[:n, None, :], (n, H, k_rope.shape[1]))
            keys = np.concatenate([k_nope[:n], rope], axis=-1)
            if split:
                dot = _split_dot(q[t], keys, k_nope.shape[-1])
            else:
                dot = (score_sum or X.lsum)(d(q[t])[None] * d(keys))
            score = f32(dot * scale)  # [n, H]
            m = np.max(score, axis=0, keepdims=True)
            e = exp(d(score) - d(m))
            p = f32(e / total(np.moveaxis(e, 0, -1))[None])
            out[t] = f32(mix(np.moveaxis(d(p)[:, :, None] * d(v[:n]), 0, -1)))
        return out
    return mla_attention


def _latent_with(q_sum: Callable[[np.ndarray], np.ndarray] = X.lsum,
                 score_sum: Callable[[np.ndarray], np.ndarray] = X.lsum,
                 mix: Callable[[np.ndarray], np.ndarray] = X.lsum,
                 out_sum: Callable[[np.ndarray], np.ndarray] = X.lsum,
                 total: Callable[[np.ndarray], np.ndarray] = X.lsum,
                 restart_at_rope: bool = False) -> Callable[..., np.ndarray]:
    """Absorbed MLA with one of its reductions done another way (every sum over the last axis)."""
    def mla_latent_attention(q, cache, w_kvb, pos0, scale):  # type: ignore[no-untyped-def]
        T, H, nr = q.shape
        C = w_kvb.shape[1]
        n = nr - (cache.shape[1] - C)
        dv = w_kvb.shape[0] // H - n
        w = X.bf16_to_f32(w_kvb) if w_kvb.dtype == np.uint16 else w_kvb
        wd = d(w).reshape(H, n + dv, C)
        out = np.empty((T, H, dv), dtype=np.float32)
        for t in range(T):
            N = pos0 + t + 1
            rows = d(cache[:N])
            q_lat = f32(q_sum(np.moveaxis(d(q[t, :, :n])[:, :, None] * wd[:, :n], 1, -1)))
            qq = d(np.concatenate([q_lat, q[t, :, n:]], axis=-1))
            if restart_at_rope:  # lanes start again at the rope dims
                dot = X.lsum(qq[None, :, :C] * rows[:, None, :C]) + X.lsum(qq[None, :, C:] * rows[:, None, C:])
            else:
                dot = score_sum(qq[None] * rows[:, None, :])
            score = f32(dot * scale)
            e = X.exp_d(d(score) - d(np.max(score, axis=0, keepdims=True)))
            p = f32(e / total(np.moveaxis(e, 0, -1))[None])
            o_lat = f32(mix(np.moveaxis(d(p)[:, :, None] * rows[:, None, :C], 0, -1)))
            out[t] = f32(out_sum(wd[:, n:] * d(o_lat)[:, None, :]))
        return out
    return mla_latent_attention


def _attn_res_with(mix: Callable[[np.ndarray], np.ndarray] = X.lsum,
                   score_sum: Callable[[np.ndarray], np.ndarray] = X.lsum) -> Callable[..., np.ndarray]:
    ref = NumpyBackend()

    def attn_res(sources, fold, eps):  # type: ignore[no-untyped-def]
        keys = ref.rmsnorm(sources, None, eps)
        score = f32(score_sum(d(keys) * d(fold)))
        m = np.max(score, axis=0, keepdims=True)
        e = X.exp_d(d(score) - d(m))
        p = f32(e / X.lsum(np.moveaxis(e, 0, -1))[None])
        return f32(mix(np.moveaxis(d(p)[:, :, None] * d(sources), 0, -1)))
    return attn_res


def _kda_recurrent_with(u_sum: Callable[[np.ndarray], np.ndarray] = X.lsum,
                        o_sum: Callable[[np.ndarray], np.ndarray] = X.lsum,
                        fma: bool = False) -> Callable[..., np.ndarray]:
    def kda_recurrent(q, k, v, alpha, beta, state):  # type: ignore[no-untyped-def]
        out = np.empty_like(v)
        for t in range(q.shape[0]):
            state *= alpha[t][:, :, None]
            u = f32(u_sum(np.moveaxis(d(k[t])[:, :, None] * d(state), 1, -1)))
            w = beta[t][:, None] * (v[t] - u)
            if fma:  # one rounding for S + k * w
                state[...] = f32(d(state) + d(k[t])[:, :, None] * d(w)[:, None, :])
            else:
                state += k[t][:, :, None] * w[:, None, :]
            out[t] = f32(o_sum(np.moveaxis(d(q[t])[:, :, None] * d(state), 1, -1)))
        return out
    return kda_recurrent


def _router_with(total: Callable[[np.ndarray], np.ndarray]) -> Callable[..., Any]:
    ref = NumpyBackend()

    def router(logits, bias, k, renorm, scale):  # type: ignore[no-untyped-def]
        s = ref.sigmoid(logits)
        idx = np.argsort(-(s + bias), axis=-1, kind="stable")[:, :k].astype(np.int64)
        w = np.take_along_axis(s, idx, axis=-1)
        if k > 1 and renorm:
            w = f32(d(w) / (total(d(w))[:, None] + 1e-20))
        return idx, w * np.float32(scale)
    return router


def _kda_gate_with(exp: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def kda_gate(z, dt_bias, a_log, lower_bound):  # type: ignore[no-untyped-def]
        D = z.shape[-1] // a_log.shape[0]
        u = np.repeat(exp(d(a_log)), D) * (d(z) + d(dt_bias))
        return f32(exp(lower_bound * lib_sig(exp)(u)))
    return kda_gate


def _situ_with(exp: Callable[[np.ndarray], np.ndarray] = X.exp_d,
               tanh: Callable[[np.ndarray], np.ndarray] = X.tanh_d) -> Callable[..., np.ndarray]:
    def situ_glu(g, u, b1, b2):  # type: ignore[no-untyped-def]
        gd, ud = d(g), d(u)
        return f32((b1 * tanh(gd / b1) * lib_sig(exp)(gd)) * (b2 * tanh(ud / b2)))
    return situ_glu


def _shortconv_fma(x, w, hist):  # type: ignore[no-untyped-def]
    T, K = x.shape[0], w.shape[1]
    y = np.empty_like(x)
    ref = NumpyBackend()
    for t in range(T):
        acc = w[:, K - 1] * x[t]
        for j in range(K - 1):
            acc = f32(d(acc) + d(w[:, j]) * d(hist[:, j]))  # fused: rounds once
        if K > 1:
            hist[:, :-1] = hist[:, 1:]
            hist[:, -1] = x[t]
        y[t] = ref.silu(acc)
    return y


# ---- the mutants: (op the suite must fail, backend) ----------------------------------------------
MUTANTS: dict[str, tuple[str, dict[str, Any]]] = {}
for _how, _total in SUMS.items():
    MUTANTS[f"rmsnorm {_how}"] = ("rmsnorm", {"rmsnorm": _rmsnorm_with(_total)})
    MUTANTS[f"l2norm {_how}"] = ("l2norm", {"l2norm": _l2norm_with(_total)})
    MUTANTS[f"matmul_f32 {_how}"] = ("matmul", {"matmul_f32": _matmul_f32_with(_total)})
    MUTANTS[f"mla mixture {_how}"] = ("mla_attention", {"mla_attention": _mla_with(mix=_total)})
    MUTANTS[f"attn_res mixture {_how}"] = ("attn_res", {"attn_res": _attn_res_with(mix=_total)})
    MUTANTS[f"attn_res score {_how}"] = ("attn_res", {"attn_res": _attn_res_with(score_sum=_total)})
    MUTANTS[f"mla score {_how}"] = ("mla_attention", {"mla_attention": _mla_with(score_sum=_total)})
    for _part in ("q_sum", "score_sum", "mix", "out_sum"):
        MUTANTS[f"mla latent {_part} {_how}"] = (
            "mla_latent_attention", {"mla_latent_attention": _latent_with(**{_part: _total})})
    MUTANTS[f"kda_recurrent output {_how}"] = (
        "kda_recurrent", {"kda_recurrent": _kda_recurrent_with(o_sum=_total)})
    MUTANTS[f"kda_recurrent state {_how}"] = (
        "kda_recurrent", {"kda_recurrent": _kda_recurrent_with(u_sum=_total)})
for _how in ("np.sum", "sequential float64", "16 lanes"):
    MUTANTS[f"mla softmax denominator {_how}"] = (
        "mla_attention", {"mla_attention": _mla_with(total=SUMS[_how])})
    MUTANTS[f"router renorm {_how}"] = ("router", {"router": _router_with(SUMS[_how])})
MUTANTS["mla latent score: lanes restart at the rope dims"] = (
    "mla_latent_attention", {"mla_latent_attention": _latent_with(restart_at_rope=True)})
MUTANTS["mla score nope and rope summed apart"] = (
    "mla_attention", {"mla_attention": _mla_with(split=True)})
for _how in ("np.sum", "sequential float64", "16 lanes"):
    MUTANTS[f"matmul_bf16 {_how}"] = ("matmul", {"matmul_bf16": _matmul_bf16_with(SUMS[_how])})
    MUTANTS[f"matmul_mxfp4 {_how}"] = ("matmul", {"matmul_mxfp4": _matmul_mxfp4_with(SUMS[_how])})
MUTANTS["matmul_f32 BLAS (@)"] = ("matmul", {"matmul_f32": lambda w, x: (x @ w.T).astype(np.float32)})
for _how, _exp in LIB_EXP.items():
    MUTANTS[f"kda_gate {_how}"] = ("kda_gate", {"kda_gate": _kda_gate_with(_exp)})
    MUTANTS[f"situ_glu sigmoid with {_how}"] = ("situ_glu", {"situ_glu": _situ_with(exp=_exp)})
    MUTANTS[f"mla softmax {_how}"] = ("mla_attention", {"mla_attention": _mla_with(exp=_exp)})
for _op in adversarial.HARD_FLOAT32:
    for _how, _exp in LIB_EXP.items():
        _fn = {"exp": lambda x, e=_exp: f32(e(d(x))),
               "sigmoid": lambda x, e=_exp: f32(lib_sig(e)(d(x))),
               "silu": lambda x, e=_exp: f32(d(x) * lib_sig(e)(d(x)))}[_op]
        MUTANTS[f"{_op} {_how}"] = (_op, {_op: _fn})
MUTANTS["situ_glu math.tanh"] = (
    "situ_glu", {"situ_glu": _situ_with(tanh=np.vectorize(math.tanh, otypes=[float]))})
MUTANTS["shortconv fused multiply-add"] = ("shortconv", {"shortconv": _shortconv_fma})
MUTANTS["kda_recurrent fused multiply-add"] = (
    "kda_recurrent", {"kda_recurrent": _kda_recurrent_with(fma=True)})

#: the suite's tests that each op's mutants are run through (beyond test_adversarial)
RANDOM_TESTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "shortconv": [("test_shortconv_state_in_place", {"C": 33, "K": 4, "T": 3})],
    "kda_recurrent": [("test_kda_recurrent_state_in_place", {"H": 2, "D": 33, "T": 3})],
}


def suite_failure(backend: Any, op: str) -> str:
    """Run the shipped suite's tests of ``op`` on ``backend``; the first failure's message."""
    suite = KernelConformance()
    try:
        if op in adversarial.OPS:
            suite.test_adversarial(backend, op)
        for test, params in RANDOM_TESTS.get(op, []):
            getattr(suite, test)(backend, **params)
    except AssertionError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_suite_catches_the_mutant(mutant: str) -> None:
    op, ops = MUTANTS[mutant]
    message = suite_failure(Mutant(**ops), op)
    assert message, f"the kernel suite passed a backend with {mutant}"
    named = "mla" if op == "mla_attention" else op
    assert named in message and "first at index" in message, message


@pytest.mark.parametrize("op", sorted(set(adversarial.OPS) | set(RANDOM_TESTS)))
def test_the_reference_passes_the_same_tests(op: str) -> None:
    assert suite_failure(Mutant(), op) == ""


@pytest.mark.parametrize("op", sorted(adversarial.HARD_FLOAT32))
def test_the_shipped_float32_inputs_expose_a_correctly_rounded_exp(op: str) -> None:
    """At each shipped input, the op written as the contract but with a correctly rounded
    float64 exp (the best a library exp does) rounds to another float32 than the reference."""
    ctx = decimal.Context(prec=60)
    for word in adversarial.HARD_FLOAT32[op]:
        x = float(np.array([word], dtype=np.uint32).view(np.float32)[0])
        if op == "exp":
            lib = float(ctx.exp(decimal.Decimal(x)))
        else:
            sig = 1.0 / (1.0 + float(ctx.exp(decimal.Decimal(-x))))
            lib = sig if op == "sigmoid" else x * sig
        ref = getattr(NumpyBackend(), op)(np.array([x], dtype=np.float32))[0]
        assert np.float32(lib) != ref, f"{op}({x!r}): a correctly rounded exp gives the same bits"


def test_a_lane_count_other_than_the_contracts_is_a_mutant() -> None:
    assert LANES == 32
    t = np.zeros(65)
    t[0], t[16], t[32] = 2.0**60, 1.0, -(2.0**60)
    assert X.lsum(t) == 1.0 and lanes_sum(t, 16) == 0.0 and np.sum(t) == 0.0
