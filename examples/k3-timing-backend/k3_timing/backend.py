"""The ``timed`` kernel backend: delegate every op to an inner backend and time it."""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any

import numpy as np

from k3.plugin import F32, U16, KernelBackend, Mxfp4, PluginError, available, create
from k3_timing.stats import OpStats, OpTable

NAME = "timed"
ENV_INNER = "K3_TIMED_INNER"
ENV_REPORT = "K3_TIMED_REPORT"


def inner_name(requested: str | None = None) -> str:
    """The backend to wrap: ``requested``, else ``$K3_TIMED_INNER``, else the best available
    one (the registry's ``auto`` order, skipping ``timed`` itself)."""
    name = requested or os.environ.get(ENV_INNER, "") or "auto"
    if name == NAME:
        raise PluginError(
            "the timed backend cannot wrap itself",
            hint=f"set {ENV_INNER} to another kernel backend (numpy, numba, avx2, ...)",
        )
    if name != "auto":
        return name
    for other in available("kernel"):  # best first, the order `auto` tries them in
        if other != NAME:
            return other
    raise PluginError("the timed backend found no other kernel backend to wrap")


def _nbytes(args: tuple[Any, ...]) -> int:
    n = 0
    for a in args:
        if isinstance(a, np.ndarray):
            n += a.nbytes
        elif isinstance(a, Mxfp4):
            n += a.packed.nbytes + a.scales.nbytes
    return n


class TimedBackend(KernelBackend):
    """Wraps ``inner`` (a registered kernel backend name) and records per-op statistics."""

    name = NAME

    def __init__(self, inner: str | None = None, threads: int | None = None) -> None:
        chosen = inner_name(inner)
        self.inner, self.inner_name = create("kernel", chosen), chosen
        if threads is not None:
            self.inner.set_threads(threads)
        self.table = OpTable()
        if os.environ.get(ENV_REPORT, "") not in ("", "0"):
            atexit.register(lambda: print(self.report(), file=sys.stderr))

    # --- statistics -----------------------------------------------------------------
    def stats(self) -> dict[str, OpStats]:
        """Per-op counters so far (a copy)."""
        return self.table.snapshot()

    def report(self) -> str:
        """The per-op table: calls, seconds, share of the total, MB of inputs, GB/s."""
        return self.table.format(f"k3 timed backend (inner: {self.inner_name})")

    def _call(self, op: str, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = getattr(self.inner, op)(*args)
        self.table.add(op, time.perf_counter() - t0, _nbytes(args))
        return out

    # --- threads ---------------------------------------------------------------------
    def set_threads(self, n: int) -> None:
        self.inner.set_threads(n)

    @property
    def threads(self) -> int:
        return self.inner.threads

    # --- every op, delegated ------------------------------------------------------------
    def matmul_bf16(self, w: U16, x: F32) -> F32:
        return self._call("matmul_bf16", w, x)

    def matmul_f32(self, w: F32, x: F32) -> F32:
        return self._call("matmul_f32", w, x)

    def matmul_mxfp4(self, w: Mxfp4, x: F32) -> F32:
        return self._call("matmul_mxfp4", w, x)

    def rmsnorm(self, x: F32, w: F32 | None, eps: float) -> F32:
        return self._call("rmsnorm", x, w, eps)

    def l2norm(self, x: F32) -> F32:
        return self._call("l2norm", x)

    def sigmoid(self, x: F32) -> F32:
        return self._call("sigmoid", x)

    def silu(self, x: F32) -> F32:
        return self._call("silu", x)

    def exp(self, x: F32) -> F32:
        return self._call("exp", x)

    def situ_glu(self, g: F32, u: F32, b1: float, b2: float) -> F32:
        return self._call("situ_glu", g, u, b1, b2)

    def shortconv(self, x: F32, w: F32, hist: F32) -> F32:
        return self._call("shortconv", x, w, hist)

    def kda_gate(self, z: F32, dt_bias: F32, a_log: F32, lower_bound: float) -> F32:
        return self._call("kda_gate", z, dt_bias, a_log, lower_bound)

    def kda_recurrent(self, q: F32, k: F32, v: F32, alpha: F32, beta: F32, state: F32) -> F32:
        return self._call("kda_recurrent", q, k, v, alpha, beta, state)

    def mla_attention(
        self, q: F32, k_nope: F32, k_rope: F32, v: F32, pos0: int, scale: float
    ) -> F32:
        return self._call("mla_attention", q, k_nope, k_rope, v, pos0, scale)

    def attn_res(self, sources: F32, fold: F32, eps: float) -> F32:
        return self._call("attn_res", sources, fold, eps)

    def router(
        self, logits: F32, bias: F32, k: int, renorm: bool, scale: float
    ) -> tuple[np.ndarray, F32]:
        return self._call("router", logits, bias, k, renorm, scale)
