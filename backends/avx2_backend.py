"""The ``avx2`` kernel backend: C kernels (AVX2, AVX-512) behind the bit-exact contract.

Every method returns the same bytes as the ``numpy`` reference backend
(:mod:`k3_backends.numpy_backend`) at every thread count; the C sources live in
``backends/avx2/`` and are compiled into ``k3_backends._k3avx2`` by ``pip install``
(``backends/avx2_build.py``). The arithmetic is the contract of :mod:`k3core.api.kernels`;
this module only validates inputs, allocates the outputs and hands pointers to C.

Threads: parallel work is split over independent outputs (rows, heads, tokens) only. The
count is ``threads=`` when given, else ``K3_THREADS``, else ``OMP_NUM_THREADS`` (its first
entry), else the CPUs this process may run on; :meth:`Avx2Backend.set_threads` changes it.
Every C call releases the GIL (cffi API mode), so Python threads can run kernels
concurrently.

The compiled module is imported only when the backend is created; the registry's probe
(:mod:`k3_backends.avx2_probe`) checks the CPU for AVX2/FMA first, so an older CPU gets a
clear refusal instead of SIGILL.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from k3_backends import avx2_probe
from numpy.typing import NDArray

from k3.plugin import (
    F32,
    U16,
    KdaSeq,
    KdaWeights,
    KernelBackend,
    KernelBackendSpec,
    MlaSeq,
    MlaWeights,
    Mxfp4,
    PluginError,
    force_parallel_from_env,
    hookimpl,
    latent_shapes,
)

_ENOMEM = -1


def default_threads() -> int:
    """``K3_THREADS``, else ``OMP_NUM_THREADS`` (first entry), else the usable CPUs."""
    for var in ("K3_THREADS", "OMP_NUM_THREADS"):
        raw = os.environ.get(var, "").strip()
        if not raw:
            continue
        first = raw.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise PluginError(
                f"kernel backend 'avx2': {var}={raw!r} is not a positive thread count",
                hint=f"set {var} to a whole number >= 1, or unset it",
            )
        return int(first)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _f32(op: str, name: str, a: Any) -> NDArray[np.float32]:
    """A read-only float32 input, made C-contiguous (copied only when it is not)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise TypeError(f"{op}: {name} must be a float32 array, got {got}")
    return np.ascontiguousarray(a)


def _inplace(op: str, name: str, a: Any) -> NDArray[np.float32]:
    """State updated in place: must already be float32, C-contiguous and writable."""
    if (
        not isinstance(a, np.ndarray)
        or a.dtype != np.float32
        or not a.flags.c_contiguous
        or not a.flags.writeable
    ):
        raise ValueError(
            f"{op}: {name} must be a writable C-contiguous float32 array (it is updated in place)"
        )
    return a


#: the (thread count, forced) this OS thread last gave the C library (its per-thread state)
_LAST_SET = threading.local()


class Avx2Backend(KernelBackend):
    """The C/AVX2 implementation of the kernel contract (see the module docstring)."""

    name = "avx2"

    def __init__(self, threads: int | None = None, force_parallel: bool | None = None) -> None:
        cpu = avx2_probe.check_cpu()
        if not cpu.ok:
            raise PluginError(f"kernel backend 'avx2' is not available here: {cpu.reason}",
                              hint=cpu.hint)
        try:
            mod = avx2_probe.load_module()
        except ImportError as exc:
            avail = avx2_probe.check_module()
            raise PluginError(
                f"kernel backend 'avx2' is not available here: {avail.reason or exc}",
                hint=avx2_probe.BUILD_HINT,
            ) from exc
        self._ffi = mod.ffi
        self._lib = mod.lib
        self._forced = force_parallel_from_env() if force_parallel is None else bool(force_parallel)
        self._wmemo: dict[int, tuple[Any, ...]] = {}  # id(weight) -> what _winfo found
        self._plans: dict[int, tuple[Any, ...]] = {}  # id(layer weights) -> what _plan found
        self.set_threads(default_threads() if threads is None else threads)

    # --- threads -----------------------------------------------------------------------
    def set_threads(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"avx2: thread count must be an integer >= 1, got {n!r}")
        self._threads = int(n)
        self._lib.k3_set_threads(self._threads)
        self._lib.k3_set_force_parallel(1 if self._forced else 0)
        _LAST_SET.n = (self._threads, self._forced)

    @property
    def threads(self) -> int:
        return self._threads

    def set_force_parallel(self, on: bool) -> None:
        self._forced = bool(on)
        self._lib.k3_set_force_parallel(1 if self._forced else 0)
        _LAST_SET.n = (self._threads, self._forced)

    @property
    def parallel_forced(self) -> bool:
        return self._forced

    # --- the machine's ceilings (not ops of the contract: `k3 bench` reads them) ---------
    def read_bandwidth_seconds(self, view: NDArray[np.uint8], passes: int) -> float:
        """The best of ``passes`` timed 256-bit read loops over ``view`` (64-byte aligned,
        a multiple of 128 bytes long) on this backend's threads, in seconds."""
        self._sync_threads()
        checksum = self._ffi.new("uint64_t *")
        return float(self._lib.k3_read_bandwidth(self._p("uint8_t[]", view), view.size, passes,
                                                 checksum))

    def fma_peak_seconds(self, iters: int, passes: int) -> tuple[float, int]:
        """The best of ``passes`` timed runs of ``iters`` steps of 12 independent float64
        FMA chains on each of this backend's threads, in seconds, and the float64 lanes of
        one chain (4: 256-bit, 8: 512-bit)."""
        self._sync_threads()
        sink = self._ffi.new("double *")
        seconds = float(self._lib.k3_fma_peak(iters, passes, sink))
        return seconds, 8 if self._lib.k3_has_avx512() else 4

    def decode_peak_seconds(self, iters: int, passes: int) -> tuple[float, int]:
        """The best of ``passes`` timed runs, on each of this backend's threads, of ``iters``
        one-token products of an L1-resident MXFP4 block by this backend's own one-token
        path, in seconds, and the weights one thread multiplies in a run: the rate at which
        packed weights become float64 lanes (the decode step's routed experts' ceiling)."""
        self._sync_threads()
        sink = self._ffi.new("double *")
        weights = self._ffi.new("int64_t *")
        seconds = float(self._lib.k3_decode_peak(iters, passes, weights, sink))
        return seconds, int(weights[0])

    # --- plumbing ----------------------------------------------------------------------
    def _p(self, ctype: str, a: np.ndarray) -> Any:
        if a.size == 0:
            return self._ffi.NULL
        return self._ffi.from_buffer(ctype, a)

    def _out(self, ctype: str, a: np.ndarray) -> Any:
        if a.size == 0:
            return self._ffi.NULL
        return self._ffi.from_buffer(ctype, a, require_writable=True)

    def _check(self, rc: int, op: str) -> None:
        if rc == _ENOMEM:
            raise MemoryError(f"avx2 {op}: could not allocate scratch memory")
        if rc != 0:
            raise ValueError(f"avx2 {op}: the kernel refused its arguments (code {rc})")

    def _sync_threads(self) -> None:
        # the C library keeps the count per calling OS thread; set it before a call whenever
        # this OS thread last set another count (backends with different counts, several
        # Python threads), and skip the foreign call on the decode loop's hot path otherwise
        mine = (self._threads, self._forced)
        if getattr(_LAST_SET, "n", None) != mine:
            self._lib.k3_set_threads(self._threads)
            self._lib.k3_set_force_parallel(1 if self._forced else 0)
            _LAST_SET.n = mine

    # --- matrix products -----------------------------------------------------------------
    def _matmul_x(self, x: Any, cols: int) -> NDArray[np.float32]:
        x = np.ascontiguousarray(x, dtype=np.float32)  # exactly as the reference
        if x.ndim != 2 or x.shape[1] != cols:
            raise ValueError(f"matmul: x has shape {x.shape}, weight has {cols} columns")
        return x

    def matmul_bf16(self, w: U16, x: F32) -> F32:
        if not isinstance(w, np.ndarray) or w.dtype != np.uint16 or w.ndim != 2:
            raise TypeError("matmul_bf16: w must be a 2-D uint16 array of bf16 bit patterns")
        w = np.ascontiguousarray(w)
        rows, cols = w.shape
        x = self._matmul_x(x, cols)
        out = np.empty((x.shape[0], rows), dtype=np.float32)
        if out.size:
            self._sync_threads()
            rc = self._lib.k3_matmul_bf16(
                self._p("uint16_t[]", w), rows, cols, self._p("float[]", x), x.shape[0],
                self._out("float[]", out),
            )
            self._check(rc, "matmul_bf16")
        return out

    def matmul_f32(self, w: F32, x: F32) -> F32:
        if not isinstance(w, np.ndarray) or w.ndim != 2:
            raise TypeError("matmul_f32: w must be a 2-D float32 array")
        w = _f32("matmul_f32", "w", w)
        rows, cols = w.shape
        x = self._matmul_x(x, cols)
        out = np.empty((x.shape[0], rows), dtype=np.float32)
        if out.size:
            self._sync_threads()
            rc = self._lib.k3_matmul_f32(
                self._p("float[]", w), rows, cols, self._p("float[]", x), x.shape[0],
                self._out("float[]", out),
            )
            self._check(rc, "matmul_f32")
        return out

    def matmul_mxfp4(self, w: Mxfp4, x: F32) -> F32:
        packed, scales = w.packed, w.scales
        for name, a in (("packed", packed), ("scales", scales)):
            if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 2:
                raise TypeError(f"matmul_mxfp4: {name} must be a 2-D uint8 array")
        rows, cols = w.shape
        _need(cols % 32 == 0, f"matmul_mxfp4: width {cols} is not a multiple of 32")
        _need(
            scales.shape == (rows, cols // 32),
            f"matmul_mxfp4: scales have shape {scales.shape}, expected {(rows, cols // 32)}",
        )
        packed, scales = np.ascontiguousarray(packed), np.ascontiguousarray(scales)
        x = self._matmul_x(x, cols)
        out = np.empty((x.shape[0], rows), dtype=np.float32)
        if out.size:
            self._sync_threads()
            rc = self._lib.k3_matmul_mxfp4(
                self._p("uint8_t[]", packed), self._p("uint8_t[]", scales), rows, cols,
                self._p("float[]", x), x.shape[0], self._out("float[]", out),
            )
            self._check(rc, "matmul_mxfp4")
        return out

    # --- fused products ----------------------------------------------------------------------
    def _kind(self, w: Any) -> int | None:
        """0 bf16, 1 float32, 2 MXFP4 for a well-formed C-contiguous weight, else None."""
        if isinstance(w, Mxfp4):
            p, sc = w.packed, w.scales
            ok = (isinstance(p, np.ndarray) and isinstance(sc, np.ndarray) and p.dtype == np.uint8
                  and sc.dtype == np.uint8 and p.ndim == 2 and p.flags.c_contiguous
                  and sc.flags.c_contiguous and p.shape[1] % 16 == 0
                  and sc.shape == (p.shape[0], p.shape[1] // 16))
            return 2 if ok else None
        if isinstance(w, np.ndarray) and w.ndim == 2 and w.flags.c_contiguous:
            return {np.dtype(np.uint16): 0, np.dtype(np.float32): 1}.get(w.dtype)
        return None

    def _winfo(self, w: Any) -> tuple[int | None, Any, Any, tuple[int, int]]:
        """``(kind, weight pointer, scales pointer, (rows, cols))`` of a weight (``_kind``;
        NULL scales unless MXFP4), remembered while the weight object lives: the trunk's matrices and
        the cached experts' views come back every token, and checking them and taking their
        pointers again cost more than several kernel calls. The pointers are plain casts
        that keep nothing alive (the caller's reference keeps the bytes alive during a call);
        the entry goes when the object does, and is taken only for the same object (an array
        with the same shape; an ``Mxfp4`` is frozen)."""
        key = id(w)
        shape = w.shape if isinstance(w, np.ndarray) else None
        hit = self._wmemo.get(key)
        if hit is not None and hit[4]() is w and hit[5] == shape:
            return hit[:4]
        ffi = self._ffi
        kind = self._kind(w)
        p = s = ffi.NULL
        if kind == 2:
            p, s = self._addr("void *", w.packed), self._addr("uint8_t *", w.scales)
        elif kind is not None:
            p = self._addr("void *", w)
        dims = (int(w.shape[0]), int(w.shape[1])) if kind is not None else (0, 0)
        try:
            ref = weakref.ref(w, lambda _r, k=key, memo=self._wmemo: memo.pop(k, None))
        except TypeError:  # an object without weak references is checked every time
            return kind, p, s, dims
        self._wmemo[key] = (kind, p, s, dims, ref, shape)
        return kind, p, s, dims

    def _addr(self, ctype: str, a: np.ndarray) -> Any:
        """A pointer to ``a``'s first byte as a cast (it does not keep ``a`` alive)."""
        if a.size == 0:
            return self._ffi.NULL
        return self._ffi.cast(ctype, self._ffi.cast("uintptr_t", self._ffi.from_buffer(a)))

    def matmul_many(self, ws: Sequence[U16 | F32 | Mxfp4], x: F32) -> list[F32]:
        """One C call per group of weights of one kind (bf16, float32, MXFP4) and width."""
        groups: dict[tuple[int | None, int], list[int]] = {}
        for i, w in enumerate(ws):
            groups.setdefault((self._winfo(w)[0], int(w.shape[1])), []).append(i)
        out: list[Any] = [None] * len(ws)
        for (kind, _), members in groups.items():
            if kind is None or len(members) < 2:
                for i in members:
                    out[i] = self.matmul(ws[i], x)
                continue
            for j in range(0, len(members), 16):
                part = members[j : j + 16]
                for i, y in zip(part, self._matmul_group(kind, [ws[i] for i in part], x),
                                strict=True):
                    out[i] = y
        return out

    def _matmul_group(self, kind: int, ws: list[Any], x: F32) -> list[F32]:
        shapes = [w.shape for w in ws]
        cols = shapes[0][1]
        x = self._matmul_x(x, cols)
        outs = [np.empty((x.shape[0], r), dtype=np.float32) for r, _ in shapes]
        if x.shape[0] == 0:
            return outs
        if any(o.size == 0 for o in outs):
            return [self.matmul(w, x) for w in ws]
        ptrs = [self._winfo(w)[1:3] for w in ws]
        ffi = self._ffi
        self._sync_threads()
        rc = self._lib.k3_matmul_many(
            kind, len(ws), ffi.new("void *[]", [p for p, _ in ptrs]),
            ffi.new("uint8_t *[]", [s for _, s in ptrs]) if kind == 2 else ffi.NULL,
            ffi.new("int64_t[]", [r for r, _ in shapes]), cols, self._p("float[]", x),
            x.shape[0], ffi.new("float *[]", [self._out("float[]", o) for o in outs]),
        )
        self._check(rc, "matmul_many")
        return outs

    def situ_mlp(
        self, w1: U16 | F32 | Mxfp4, w3: U16 | F32 | Mxfp4, w2: U16 | F32 | Mxfp4, x: F32,
        b1: float, b2: float,
    ) -> F32:
        infos = [self._winfo(w) for w in (w1, w3, w2)]
        kinds = {i[0] for i in infos}
        inter, cols = w1.shape
        out_rows = w2.shape[0]
        if (len(kinds) != 1 or None in kinds or w3.shape != (inter, cols)
                or w2.shape[1] != inter or min(inter, cols, out_rows) == 0):
            return super().situ_mlp(w1, w3, w2, x, b1, b2)
        x = self._matmul_x(x, cols)
        out = np.empty((x.shape[0], out_rows), dtype=np.float32)
        if x.shape[0] == 0:
            return out
        (_, p1, s1, _), (_, p3, s3, _), (_, p2, s2, _) = infos
        self._sync_threads()
        rc = self._lib.k3_situ_mlp(kinds.pop(), p1, s1, p3, s3, p2, s2, inter, cols, out_rows,
                                   self._p("float[]", x), x.shape[0], float(b1), float(b2),
                                   self._out("float[]", out))
        self._check(rc, "situ_mlp")
        return out

    def situ_mlp_many(
        self, mlps: Sequence[tuple[U16 | F32 | Mxfp4, U16 | F32 | Mxfp4, U16 | F32 | Mxfp4]],
        xs: Sequence[F32], b1: float, b2: float,
    ) -> list[F32]:
        """Every MLP in one C call when all have one kind and one shape (the routed experts
        of a layer); otherwise one ``situ_mlp`` call each."""
        if len(mlps) != len(xs):
            raise ValueError(f"situ_mlp_many: {len(mlps)} MLPs but {len(xs)} inputs")
        if not mlps:
            return []
        inter, cols = mlps[0][0].shape
        out_rows = mlps[0][2].shape[0]
        infos = [[self._winfo(w) for w in mlp] for mlp in mlps]
        kinds = {i[0] for info in infos for i in info}
        same = all(i1[3] == i3[3] == (inter, cols) and i2[3] == (out_rows, inter)
                   for i1, i3, i2 in infos)
        if len(kinds) != 1 or None in kinds or not same or min(inter, cols, out_rows) == 0:
            return super().situ_mlp_many(mlps, xs, b1, b2)
        kind = kinds.pop()
        xs = [self._matmul_x(x, cols) for x in xs]
        outs = [np.empty((x.shape[0], out_rows), dtype=np.float32) for x in xs]
        if not any(x.shape[0] for x in xs):
            return outs
        ffi = self._ffi
        ptrs = [[i[1:3] for i in info] for info in infos]

        def arr(ctype: str, vals: list[Any]) -> Any:
            return ffi.new(ctype, vals)

        def scales(j: int) -> Any:
            return arr("uint8_t *[]", [p[j][1] for p in ptrs]) if kind == 2 else ffi.NULL

        xp = [self._p("float[]", x) for x in xs]  # NULL for an expert with no rows: never read
        yp = [self._out("float[]", o) for o in outs]
        self._sync_threads()
        rc = self._lib.k3_situ_mlp_many(
            kind, len(mlps), arr("void *[]", [p[0][0] for p in ptrs]), scales(0),
            arr("void *[]", [p[1][0] for p in ptrs]), scales(1),
            arr("void *[]", [p[2][0] for p in ptrs]), scales(2), inter, cols, out_rows,
            arr("float *[]", xp), arr("int64_t[]", [x.shape[0] for x in xs]), float(b1), float(b2),
            arr("float *[]", yp),
        )
        self._check(rc, "situ_mlp_many")
        return outs

    # --- normalisation and activations ---------------------------------------------------
    def _rows(self, op: str, x: Any) -> tuple[NDArray[np.float32], int, int]:
        x = _f32(op, "x", x)
        _need(x.ndim >= 1 and x.shape[-1] >= 1, f"{op}: x must have a non-empty last axis")
        m = int(x.shape[-1])
        return x, x.size // m, m

    def rmsnorm(self, x: F32, w: F32 | None, eps: float) -> F32:
        x, rows, m = self._rows("rmsnorm", x)
        wp = self._ffi.NULL
        if w is not None:
            w = _f32("rmsnorm", "w", w)
            _need(w.shape == (m,), f"rmsnorm: gain has shape {w.shape}, expected ({m},)")
            wp = self._p("float[]", w)
        out = np.empty_like(x)
        if out.size:
            self._sync_threads()
            self._lib.k3_rmsnorm(self._p("float[]", x), rows, m, wp, float(eps),
                                 self._out("float[]", out))
        return out

    def l2norm(self, x: F32) -> F32:
        x, rows, m = self._rows("l2norm", x)
        out = np.empty_like(x)
        if out.size:
            self._sync_threads()
            self._lib.k3_l2norm(self._p("float[]", x), rows, m, self._out("float[]", out))
        return out

    def _unary(self, op: str, fn: Any, x: Any) -> F32:
        x = _f32(op, "x", x)
        out = np.empty_like(x)
        if out.size:
            self._sync_threads()
            fn(self._p("float[]", x), x.size, self._out("float[]", out))
        return out

    def sigmoid(self, x: F32) -> F32:
        return self._unary("sigmoid", self._lib.k3_sigmoid, x)

    def silu(self, x: F32) -> F32:
        return self._unary("silu", self._lib.k3_silu, x)

    def exp(self, x: F32) -> F32:
        return self._unary("exp", self._lib.k3_exp, x)

    def situ_glu(self, g: F32, u: F32, b1: float, b2: float) -> F32:
        g, u = _f32("situ_glu", "g", g), _f32("situ_glu", "u", u)
        _need(g.shape == u.shape, f"situ_glu: g has shape {g.shape} but u has {u.shape}")
        out = np.empty_like(g)
        if out.size:
            self._sync_threads()
            self._lib.k3_situ_glu(self._p("float[]", g), self._p("float[]", u), g.size,
                                  float(b1), float(b2), self._out("float[]", out))
        return out

    # --- attention building blocks --------------------------------------------------------
    def shortconv(self, x: F32, w: F32, hist: F32) -> F32:
        x, w = _f32("shortconv", "x", x), _f32("shortconv", "w", w)
        hist = _inplace("shortconv", "hist", hist)
        _need(x.ndim == 2 and w.ndim == 2 and w.shape[1] >= 1,
              f"shortconv: expected x[T,C], w[C,K]; got {x.shape}, {w.shape}")
        T, C = x.shape
        K = w.shape[1]
        _need(w.shape[0] == C and hist.shape == (C, K - 1),
              f"shortconv: x {x.shape}, w {w.shape} and hist {hist.shape} do not agree "
              f"(expected w[{C},K], hist[{C},K-1])")
        out = np.empty_like(x)
        if out.size:
            self._sync_threads()
            self._lib.k3_shortconv(self._p("float[]", x), T, C, self._p("float[]", w), K,
                                   self._out("float[]", hist), self._out("float[]", out))
        return out

    def kda_gate(self, z: F32, dt_bias: F32, a_log: F32, lower_bound: float) -> F32:
        z = _f32("kda_gate", "z", z)
        dt_bias, a_log = _f32("kda_gate", "dt_bias", dt_bias), _f32("kda_gate", "a_log", a_log)
        _need(z.ndim >= 1 and a_log.ndim == 1 and a_log.shape[0] >= 1,
              f"kda_gate: expected z[..., P] and A_log[H]; got {z.shape}, {a_log.shape}")
        P, H = int(z.shape[-1]), int(a_log.shape[0])
        _need(P % H == 0, f"kda_gate: width {P} is not a multiple of {H} heads")
        _need(dt_bias.shape == (P,), f"kda_gate: dt_bias has shape {dt_bias.shape}, expected ({P},)")
        out = np.empty_like(z)
        if out.size:
            self._sync_threads()
            self._lib.k3_kda_gate(self._p("float[]", z), z.size // P, H, P // H,
                                  self._p("float[]", dt_bias), self._p("float[]", a_log),
                                  float(lower_bound), self._out("float[]", out))
        return out

    def kda_recurrent(self, q: F32, k: F32, v: F32, alpha: F32, beta: F32, state: F32) -> F32:
        op = "kda_recurrent"
        q, k, v = _f32(op, "q", q), _f32(op, "k", k), _f32(op, "v", v)
        alpha, beta = _f32(op, "alpha", alpha), _f32(op, "beta", beta)
        state = _inplace(op, "state", state)
        _need(q.ndim == 3 and state.ndim == 3, f"{op}: expected q[T,H,D] and S[H,D,D]")
        T, H, Dk = q.shape
        Dv = int(state.shape[2])
        _need(
            k.shape == q.shape and alpha.shape == q.shape and v.shape == (T, H, Dv)
            and beta.shape == (T, H) and state.shape == (H, Dk, Dv),
            f"{op}: shapes do not agree: q {q.shape} k {k.shape} v {v.shape} alpha "
            f"{alpha.shape} beta {beta.shape} S {state.shape}",
        )
        out = np.empty_like(v)
        if out.size or state.size:
            self._sync_threads()
            rc = self._lib.k3_kda_recurrent(
                self._p("float[]", q), self._p("float[]", k), self._p("float[]", v),
                self._p("float[]", alpha), self._p("float[]", beta), T, H, Dk, Dv,
                self._out("float[]", state), self._out("float[]", out),
            )
            self._check(rc, op)
        return out

    def mla_attention(
        self, q: F32, k_nope: F32, k_rope: F32, v: F32, pos0: int, scale: float
    ) -> F32:
        op = "mla_attention"
        q, k_nope = _f32(op, "q", q), _f32(op, "k_nope", k_nope)
        k_rope, v = _f32(op, "k_rope", k_rope), _f32(op, "v", v)
        _need(q.ndim == 3 and k_nope.ndim == 3 and k_rope.ndim == 2 and v.ndim == 3,
              f"{op}: expected q[T,H,n+r], k_nope[S,H,n], k_rope[S,r], v[S,H,dv]")
        T, H, qh = q.shape
        S, _, n = k_nope.shape
        r, dv = int(k_rope.shape[1]), int(v.shape[2])
        _need(
            k_nope.shape[1] == H and qh == n + r and k_rope.shape[0] == S
            and v.shape[:2] == (S, H),
            f"{op}: shapes do not agree: q {q.shape} k_nope {k_nope.shape} k_rope "
            f"{k_rope.shape} v {v.shape}",
        )
        pos0 = int(pos0)
        _need(0 <= pos0 and pos0 + T <= S,
              f"{op}: queries at {pos0}..{pos0 + T - 1} need {pos0 + T} cached positions, have {S}")
        out = np.empty((T, H, dv), dtype=np.float32)
        if out.size:
            self._sync_threads()
            rc = self._lib.k3_mla_attention(
                self._p("float[]", q), self._p("float[]", k_nope), self._p("float[]", k_rope),
                self._p("float[]", v), T, H, n, r, dv, S, pos0, float(scale),
                self._out("float[]", out),
            )
            self._check(rc, op)
        return out

    def mla_latent_attention(
        self, q: F32, cache: F32, w_kvb: U16 | F32, pos0: int, scale: float
    ) -> F32:
        op = "mla_latent_attention"
        q, cache = _f32(op, "q", q), _f32(op, "cache", cache)
        pos0 = int(pos0)
        T, H, n, C, r, dv = latent_shapes(q, cache, w_kvb, pos0)
        w = np.ascontiguousarray(w_kvb)
        out = np.empty((T, H, dv), dtype=np.float32)
        if out.size:
            self._sync_threads()
            wp = self._p("uint8_t[]", w.view(np.uint8))
            rc = self._lib.k3_mla_latent_attention(
                self._p("float[]", q), self._p("float[]", cache), self._ffi.cast("void *", wp),
                0 if w.dtype == np.uint16 else 1, T, H, n, C, r, dv, pos0, float(scale),
                self._out("float[]", out),
            )
            self._check(rc, op)
        return out

    def attn_res(self, sources: F32, fold: F32, eps: float) -> F32:
        op = "attn_res"
        sources, fold = _f32(op, "sources", sources), _f32(op, "fold", fold)
        _need(sources.ndim == 3 and sources.shape[0] >= 1 and sources.shape[2] >= 1,
              f"{op}: expected sources[S,T,E] with S, E >= 1; got {sources.shape}")
        S, T, E = sources.shape
        _need(fold.shape == (E,), f"{op}: fold has shape {fold.shape}, expected ({E},)")
        out = np.empty((T, E), dtype=np.float32)
        if out.size:
            self._sync_threads()
            rc = self._lib.k3_attn_res(self._p("float[]", sources), S, T, E,
                                       self._p("float[]", fold), float(eps),
                                       self._out("float[]", out))
            self._check(rc, op)
        return out

    def router(
        self, logits: F32, bias: F32, k: int, renorm: bool, scale: float
    ) -> tuple[NDArray[np.int64], F32]:
        logits, bias = _f32("router", "logits", logits), _f32("router", "bias", bias)
        _need(logits.ndim == 2, f"router: logits must be [T, N], got {logits.shape}")
        T, N = logits.shape
        _need(bias.shape == (N,), f"router: bias has shape {bias.shape}, expected ({N},)")
        k = int(k)
        _need(k >= 0, f"router: k must be >= 0, got {k}")
        kk = min(k, N)
        idx = np.empty((T, kk), dtype=np.int64)
        w = np.empty((T, kk), dtype=np.float32)
        if idx.size:
            self._sync_threads()
            rc = self._lib.k3_router(
                self._p("float[]", logits), T, N, self._p("float[]", bias), k, kk,
                1 if renorm else 0, float(scale), self._out("int64_t[]", idx),
                self._out("float[]", w),
            )
            self._check(rc, "router")
        return idx, w

    # --- fused layer parts ---------------------------------------------------------------------
    def attn_res_norm(self, sources: F32, fold: F32, w: F32, eps: float) -> F32:
        op = "attn_res_norm"
        sources, fold = _f32(op, "sources", sources), _f32(op, "fold", fold)
        w = _f32(op, "w", w)
        _need(sources.ndim == 3 and sources.shape[0] >= 1 and sources.shape[2] >= 1,
              f"{op}: expected sources[S,T,E] with S, E >= 1; got {sources.shape}")
        S, T, E = sources.shape
        _need(fold.shape == (E,) and w.shape == (E,),
              f"{op}: fold {fold.shape} and gain {w.shape} must both be ({E},)")
        out = np.empty((T, E), dtype=np.float32)
        if out.size:
            self._sync_threads()
            rc = self._lib.k3_attn_res_norm(self._p("float[]", sources), S, T, E,
                                            self._p("float[]", fold), self._p("float[]", w),
                                            float(eps), self._out("float[]", out))
            self._check(rc, op)
        return out

    def _plan(self, w: Any, check: Any) -> tuple[Any, ...] | None:
        """What a fused layer part hands C for the layer weights ``w`` (``check(w)``: its
        checks passed), or None where the separate ops must run (matrices of mixed kinds,
        unexpected shapes); remembered while ``w`` lives, as ``_winfo`` remembers a weight."""
        key = id(w)
        hit = self._plans.get(key)
        if hit is not None and hit[0]() is w:
            return hit[1]
        plan = check(w)
        self._plans[key] = (weakref.ref(w, lambda _r, k=key, m=self._plans: m.pop(k, None)), plan)
        return plan

    def _kda_check(self, w: KdaWeights) -> tuple[Any, ...] | None:
        mats = [*w.proj, w.f_b, w.o_proj]
        infos = [self._winfo(m) for m in mats]
        kinds = {i[0] for i in infos}
        if len(kinds) != 1 or None in kinds:
            return None
        vecs = [w.dt_bias, w.a_log, w.o_norm, *w.conv]
        if not all(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.flags.c_contiguous
                   for v in vecs):
            return None
        (P, E), (_, E_k), (_, E_v), (H, E_b), (R, E_a), (Pg, E_g) = (i[3] for i in infos[:6])
        fb, op = infos[6][3], infos[7][3]
        H = int(H)
        if H < 1 or P % H or len({E, E_k, E_v, E_b, E_a, E_g}) != 1 or Pg != P:
            return None
        D = P // H
        K = int(w.conv[0].shape[1]) if w.conv[0].ndim == 2 else 0
        if (infos[1][3][0] != P or infos[2][3][0] != P or fb != (P, R) or op[1] != P
                or w.dt_bias.shape != (P,) or w.a_log.shape != (H,) or w.o_norm.shape != (D,)
                or K < 1 or any(c.shape != (P, K) for c in w.conv) or min(E, R, op[0]) < 1):
            return None
        ffi = self._ffi
        kind = kinds.pop()
        proj = ffi.new("void *[]", [i[1] for i in infos[:6]])
        proj_s = ffi.new("uint8_t *[]", [i[2] for i in infos[:6]]) if kind == 2 else ffi.NULL
        conv = ffi.new("float *[]", [self._addr("float *", c) for c in w.conv])
        keep = (mats, vecs)  # the arrays behind the casts live as long as the plan
        return (kind, proj, proj_s, infos[6][1], infos[6][2], infos[7][1], infos[7][2],
                self._addr("float *", w.dt_bias), self._addr("float *", w.a_log),
                conv, K, self._addr("float *", w.o_norm), E, H, D, R, op[0], keep)

    def kda_mix(self, x: F32, w: KdaWeights, seqs: Sequence[KdaSeq]) -> F32:
        plan = self._plan(w, self._kda_check)
        T = int(x.shape[0]) if isinstance(x, np.ndarray) and x.ndim == 2 else -1
        if plan is None or T < 1 or not seqs:
            return super().kda_mix(x, w, seqs)
        (kind, proj, proj_s, fb, fb_s, op, op_s, dt, al, conv, K, on, E, H, D, R, rows,
         _keep) = plan
        P = H * D
        x = self._matmul_x(x, E)
        if sum(s.rows for s in seqs) != T:
            raise ValueError(f"kda_mix: the sequences' rows do not add up to the {T} input rows")
        hist, state = [], []
        for s in seqs:
            for j, h in enumerate(s.hist):
                h = _inplace("kda_mix", f"hist[{j}]", h)
                _need(h.shape == (P, K - 1), f"kda_mix: a history has shape {h.shape}, "
                      f"expected ({P}, {K - 1})")
                hist.append(self._out("float[]", h))
            st = _inplace("kda_mix", "state", s.state)
            _need(st.shape == (H, D, D), f"kda_mix: a state has shape {st.shape}, "
                  f"expected ({H}, {D}, {D})")
            state.append(self._out("float[]", st))
        ffi = self._ffi
        out = np.empty((T, rows), dtype=np.float32)
        self._sync_threads()
        rc = self._lib.k3_kda_mix(
            kind, proj, proj_s, fb, fb_s, op, op_s, dt, al, float(w.lower_bound), conv, K, on,
            float(w.eps), float(np.float32(w.q_scale)), E, H, D, R, rows,
            self._p("float[]", x), T, len(seqs), ffi.new("int64_t[]", [s.rows for s in seqs]),
            ffi.new("float *[]", hist), ffi.new("float *[]", state), self._out("float[]", out))
        self._check(rc, "kda_mix")
        return out

    def _mla_check(self, w: MlaWeights) -> tuple[Any, ...] | None:
        mats = [w.q_a, w.kv_a, w.q_b, w.o_proj] + ([w.gate] if w.gate is not None else [])
        infos = [self._winfo(m) for m in mats]
        kinds = {i[0] for i in infos}
        kvb = w.kv_b
        if (len(kinds) != 1 or None in kinds or not isinstance(kvb, np.ndarray)
                or kvb.dtype not in (np.uint16, np.float32) or kvb.ndim != 2
                or not kvb.flags.c_contiguous):
            return None
        if not all(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.flags.c_contiguous
                   for v in (w.q_a_norm, w.kv_a_norm)):
            return None
        (QL, E), (W, E_kv), (qw, QL_b), (out_rows, HDv) = (i[3] for i in infos[:4])
        H, C = int(w.heads), int(w.kv_lora)
        r = W - C
        if H < 1 or qw % H or kvb.shape[0] % H or kvb.shape[1] != C:
            return None
        n = qw // H - r
        dv = kvb.shape[0] // H - n
        if (E_kv != E or QL_b != QL or HDv != H * dv or min(E, QL, C, n, dv, out_rows) < 1
                or r < 0 or w.q_a_norm.shape != (QL,) or w.kv_a_norm.shape != (C,)
                or (w.gate is not None and infos[4][3] != (H * dv, E))):
            return None
        gate = infos[4] if w.gate is not None else (None, self._ffi.NULL, self._ffi.NULL, None)
        kv_p = self._addr("void *", kvb)
        keep = (mats, kvb, w.q_a_norm, w.kv_a_norm)
        return (kinds.pop(), infos[0][1:3], infos[1][1:3], gate[1:3],
                self._addr("float *", w.q_a_norm), self._addr("float *", w.kv_a_norm),
                infos[2][1:3], kv_p, 0 if kvb.dtype == np.uint16 else 1, infos[3][1:3],
                E, QL, C, r, H, n, dv, out_rows, keep)

    def mla_mix(self, x: F32, w: MlaWeights, seqs: Sequence[MlaSeq]) -> F32:
        plan = self._plan(w, self._mla_check)
        T = int(x.shape[0]) if isinstance(x, np.ndarray) and x.ndim == 2 else -1
        if plan is None or T < 1 or not seqs:
            return super().mla_mix(x, w, seqs)
        (kind, qa, kva, gate, qan, kvan, qb, kvb, kv_kind, op, E, QL, C, r, H, n, dv, rows,
         _keep) = plan
        x = self._matmul_x(x, E)
        if sum(s.rows for s in seqs) != T:
            raise ValueError(f"mla_mix: the sequences' rows do not add up to the {T} input rows")
        caches = []
        for s in seqs:
            c = _inplace("mla_mix", "cache", s.cache)
            _need(c.ndim == 2 and c.shape[1] == C + r and 0 <= s.pos
                  and s.pos + s.rows <= c.shape[0] and 0 <= s.attend <= s.rows,
                  f"mla_mix: a cache of shape {c.shape} cannot take {s.rows} rows at position "
                  f"{s.pos} ({s.attend} attending; {C + r} columns expected)")
            caches.append(self._out("float[]", c))
        ffi = self._ffi
        Q = sum(s.attend for s in seqs)
        out = np.empty((Q, rows), dtype=np.float32)
        self._sync_threads()
        rc = self._lib.k3_mla_mix(
            kind, *qa, *kva, *gate, qan, kvan, *qb, kvb, kv_kind, *op, E, QL, C, r, H, n, dv,
            rows, float(w.scale), float(w.eps), self._p("float[]", x), T, len(seqs),
            ffi.new("int64_t[]", [s.rows for s in seqs]), ffi.new("float *[]", caches),
            ffi.new("int64_t[]", [s.pos for s in seqs]),
            ffi.new("int64_t[]", [s.attend for s in seqs]),
            self._out("float[]", out) if out.size else ffi.NULL)
        self._check(rc, "mla_mix")
        return out

    def moe_route(self, sources: F32, fold: F32, norm: F32, eps: float,
                  gate: U16 | F32 | Mxfp4, down: U16 | F32 | Mxfp4, bias: F32, k: int,
                  renorm: bool, scale: float) -> tuple[F32, NDArray[np.int64], F32, F32]:
        op = "moe_route"
        g_kind, g_p, g_s, (N, E_g) = self._winfo(gate)
        d_kind, d_p, d_s, (lat, E_d) = self._winfo(down)
        sources, fold = _f32(op, "sources", sources), _f32(op, "fold", fold)
        norm, bias = _f32(op, "norm", norm), _f32(op, "bias", bias)
        k = int(k)
        if (g_kind is None or g_kind != d_kind or sources.ndim != 3 or k < 0
                or not sources.shape[0] or not sources.shape[1] or not N or not lat
                or E_g != sources.shape[2] or E_d != E_g or fold.shape != (E_g,)
                or norm.shape != (E_g,) or bias.shape != (N,)):
            return super().moe_route(sources, fold, norm, eps, gate, down, bias, k, renorm, scale)
        S, T, E = sources.shape
        kk = min(k, N)
        xn = np.empty((T, E), dtype=np.float32)
        idx = np.empty((T, kk), dtype=np.int64)
        w = np.empty((T, kk), dtype=np.float32)
        z = np.empty((T, lat), dtype=np.float32)
        self._sync_threads()
        rc = self._lib.k3_moe_route(
            self._p("float[]", sources), S, T, E, self._p("float[]", fold),
            self._p("float[]", norm), float(eps), g_kind, g_p, g_s, d_p, d_s, N, lat,
            self._p("float[]", bias), k, kk, 1 if renorm else 0, float(scale),
            self._out("float[]", xn), self._out("int64_t[]", idx) if idx.size else self._ffi.NULL,
            self._out("float[]", w) if w.size else self._ffi.NULL, self._out("float[]", z))
        self._check(rc, op)
        return xn, idx, w, z

    def moe_combine(self, w: F32, outs: F32, norm: F32 | None, eps: float,
                    up: U16 | F32 | Mxfp4, shared: F32 | None) -> F32:
        op = "moe_combine"
        kind, up_p, up_s, (E, lat_up) = self._winfo(up)
        w, outs = _f32(op, "w", w), _f32(op, "outs", outs)
        if kind is None or outs.ndim != 3 or w.shape != outs.shape[:2] or lat_up != outs.shape[2]:
            return super().moe_combine(w, outs, norm, eps, up, shared)
        T, k, lat = outs.shape
        np_ = self._ffi.NULL
        if norm is not None:
            norm = _f32(op, "norm", norm)
            _need(norm.shape == (lat,), f"{op}: norm has shape {norm.shape}, expected ({lat},)")
            np_ = self._p("float[]", norm)
        sp = self._ffi.NULL
        if shared is not None:
            shared = _f32(op, "shared", shared)
            _need(shared.shape == (T, E), f"{op}: shared has shape {shared.shape}, expected "
                  f"({T}, {E})")
            sp = self._p("float[]", shared)
        out = np.empty((T, E), dtype=np.float32)
        if out.size and lat:
            self._sync_threads()
            rc = self._lib.k3_moe_combine(self._p("float[]", w), self._p("float[]", outs), T, k,
                                          lat, np_, float(eps), kind, up_p, up_s, E, sp,
                                          self._out("float[]", out))
            self._check(rc, op)
            return out
        return super().moe_combine(w, outs, norm, eps, up, shared)



@hookimpl
def k3_kernel_backends() -> list[KernelBackendSpec]:
    return [
        KernelBackendSpec(
            name="avx2",
            factory="k3_backends.avx2_backend:Avx2Backend",
            description="C kernels with AVX2 or AVX-512 (bit-identical to numpy)",
            priority=20,
            probe=avx2_probe.probe,
            install_hint=avx2_probe.BUILD_HINT,
        )
    ]
