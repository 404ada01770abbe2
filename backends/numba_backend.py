"""The ``numba`` kernel backend: the bit-exact contract compiled with Numba, multi-threaded.

Every op returns the same bytes as the NumPy reference (``k3_backends.numpy_backend``) at
every thread count: the kernels in :mod:`k3_backends.numba_kernels` follow the contract's
operation order element by element (``fastmath=False``, no FMA, the project's own
transcendentals, the 32-lane float64 sum) and split work only over independent outputs
(matrix rows, tokens, heads, channels).

This module only describes and wraps the kernels; Numba itself is imported when a backend
is created, so ``k3 backends`` can report "numba is not installed" instead of failing to load
the plugin. Compiled kernels are cached on disk (``cache=True``): the first process pays the
compilation, later ones load machine code.

Threads: unless ``NUMBA_THREADING_LAYER`` says otherwise, the backend asks Numba for its
OpenMP layer on Linux, where Numba's wheels use GNU OpenMP, and for its ``workqueue`` layer
where OpenMP cannot load and on other systems. The choice is the launch cost: a decode step
of medium makes about 500 parallel launches, and ``workqueue`` wakes its sleeping workers
for each one (50-100 us a launch on a Zen 4 guest, against 2 us for OpenMP, whose workers
spin a while after a region before they sleep): numba's resident decode took 0.19 s/token
with ``workqueue`` and 0.11 with OpenMP (docs/measurements/2026-12-07-numba-openmp-zen4.md).
OpenMP's spin is bounded: unless ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` is set, the
backend sets ``GOMP_SPINCOUNT`` to :data:`GOMP_SPIN` before OpenMP loads. GNU OpenMP's own
default (300,000 spins) is what made OpenMP the slow choice once: with both cores busy with
other work, its spinning workers took the cores from the threads doing the work, and a
two-thread decode ran 0.82 s/token against ``workqueue``'s 0.37; at 30,000 spins it ran
0.31. Every kernel launch goes through one lock (``workqueue`` must not be entered from two
threads at once; kernels release the GIL, and the lock only serialises this backend's own
parallel launches). A kernel given a single thread runs its serial build on the calling
thread and never touches the threading layer. GNU OpenMP is not fork-safe: a process that
forks without exec must not launch parallel kernels in the child (k3 never does; its
workers are started with exec).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from k3.plugin import (
    F32,
    U16,
    Availability,
    K3Error,
    KernelBackend,
    KernelBackendSpec,
    Mxfp4,
    force_parallel_from_env,
    hookimpl,
    latent_shapes,
)

_INSTALL_HINT = "pip install numba"
#: Bytes of weights (or equivalent work) per thread below which extra threads are not woken,
#: under ``workqueue`` (whose launch wakes a sleeping worker: 50-100 us on a Zen 4 guest).
PARALLEL_GRAIN = 1 << 20
#: The same under OpenMP, whose launch costs about 2 us while its workers spin: a 15-row
#: expert product of [672 x 768] MXFP4 (2 MB of work by this measure) ran 0.69 ms on one
#: thread and 0.35 ms on two, and at 1 MB it had stayed on one.
OMP_GRAIN = 1 << 18
#: Weight bytes of one task of the several-token dense products (``matmul.py``'s
#: ``_dense_t4``): its row tiles stay in the core's L2 while every token quad passes them.
TILE_BYTES = 1 << 17
#: Work of one KDA gate element, in the grain's bytes (two exps and a division, vectorised).
GATE_WORK = 256
#: Work of one SiTU element, in the grain's bytes (about 45 cycles vectorised, as 384 bytes
#: of a bf16 product at 30 GB/s).
SITU_WORK = 384
#: Serialises kernel launches (the workqueue threading layer is not re-entrant).
_LAUNCH = threading.Lock()
#: GNU OpenMP's spins after a parallel region before a worker sleeps (``GOMP_SPINCOUNT``),
#: unless the environment chooses (see the module docstring).
GOMP_SPIN = 30000


def _choose_threading_layer(numba: Any) -> None:
    """OpenMP first on Linux (``workqueue`` when it cannot load), ``workqueue`` elsewhere,
    unless ``NUMBA_THREADING_LAYER``, ``NUMBA_THREADING_LAYER_PRIORITY`` or the caller's
    ``numba.config`` chose; OpenMP's spin
    bounded unless the environment sets it (see the module docstring)."""
    if (os.environ.get("NUMBA_THREADING_LAYER") or os.environ.get("NUMBA_THREADING_LAYER_PRIORITY")
            or numba.config.THREADING_LAYER != "default"):
        return
    if not sys.platform.startswith("linux"):
        numba.config.THREADING_LAYER = "workqueue"
        return
    if not (os.environ.get("GOMP_SPINCOUNT") or os.environ.get("OMP_WAIT_POLICY")):
        os.environ["GOMP_SPINCOUNT"] = str(GOMP_SPIN)  # read when libgomp loads
    # Numba takes only a permutation of all three; workqueue always loads, so tbb is never
    # reached. Said in the environment too: Numba re-reads its config from the NUMBA_*
    # variables whenever one changes, and would put its own order back.
    os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = "omp workqueue tbb"
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]


def _kernels() -> SimpleNamespace:
    """Import Numba and the kernel modules (loads cached machine code, or compiles lazily)."""
    import numba

    _choose_threading_layer(numba)
    from k3_backends.numba_kernels import (
        attention,
        bits,
        cache,
        exact,
        experts,
        jit,
        matmul,
        pointwise,
        recurrent,
        router,
    )

    modules = (attention, bits, exact, experts, matmul, pointwise, recurrent, router)
    cache.drop_stale(obj for m in modules for obj in vars(m).values())
    if cache.cold(obj for m in modules for obj in vars(m).values()):
        print("note: numba has no compiled k3 kernels cached yet: the first step compiles "
              "them (several seconds, once; later runs load them from the cache)",
              file=sys.stderr, flush=True)
    return SimpleNamespace(
        numba=numba,
        attention=attention,
        bits=bits,
        experts=experts,
        jit=jit,
        matmul=matmul,
        pointwise=pointwise,
        recurrent=recurrent,
        router=router,
    )


def _ro(a: np.ndarray) -> np.ndarray:
    """A read-only view: kernels get one compiled variant per input, whatever the caller's
    flags (weights memory-mapped from a checkpoint are read-only, activations are not)."""
    v = a.view()
    v.flags.writeable = False
    return v


def _f32(a: Any) -> np.ndarray:
    """An input as a read-only C-contiguous float32 array (copied only when it must be)."""
    return _ro(np.ascontiguousarray(a, dtype=np.float32))


def _widen_padded(x: np.ndarray) -> np.ndarray:
    """``x`` widened to float64 (exact), with zero rows up to a multiple of four tokens."""
    T = x.shape[0]
    xd = np.zeros((-(-T // 4) * 4, x.shape[1]), dtype=np.float64)
    xd[:T] = x
    return xd


def _even_odd(xd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The even and odd columns of widened activations ``xd`` (``[..., cols]``), each
    read-only and C-contiguous: the MXFP4 rows' and the bf16 pairs' halves."""
    return (_ro(np.ascontiguousarray(xd[..., 0::2])), _ro(np.ascontiguousarray(xd[..., 1::2])))


def _rows(x: np.ndarray) -> np.ndarray:
    """View ``x`` (float32, C-contiguous) as ``[rows, last]``."""
    return x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)


def _grouped_mxfp4(mlps: Sequence[tuple[Any, Any, Any]],
                   xs: Sequence[Any]) -> tuple[int, int, int] | None:
    """``(inter, cols, out_rows)`` where at least two experts are all MXFP4 of one shape
    (W1 and W3 ``[inter x cols]``, W2 ``[out_rows x inter]``, whole 32-column groups) and
    every input is float32 ``[T, cols]`` with ``T >= 1``; else None."""
    if len(mlps) < 2 or not all(isinstance(w, Mxfp4) for m in mlps for w in m):
        return None
    (inter, cols), (out_rows, inner) = mlps[0][0].shape, mlps[0][2].shape
    if inner != inter or cols % 32 or inter % 32:
        return None
    for (w1, w3, w2), x in zip(mlps, xs, strict=True):
        if w1.shape != (inter, cols) or w3.shape != (inter, cols) or w2.shape != (out_rows, inter):
            return None
        if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2
                and x.shape[0] >= 1 and x.shape[1] == cols):
            return None
        for w in (w1, w3, w2):
            if w.scales.shape != (w.shape[0], w.shape[1] // 32):
                return None
    return inter, cols, out_rows


def _padded_blocks(blocks: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``blocks`` (float32 ``[T_i, cols]``) widened to float64 into one array, each block
    padded with zero rows to a multiple of four; and each block's first row in it."""
    sizes = [-(-b.shape[0] // 4) * 4 for b in blocks]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    xd = np.zeros((int(starts[-1]), blocks[0].shape[1]), dtype=np.float64)
    for b, s in zip(blocks, starts[:-1].tolist(), strict=True):
        xd[s : s + b.shape[0]] = b
    return xd, starts[:-1]


def _addresses(ws: Sequence[Any]) -> tuple[np.ndarray, list[np.ndarray], int]:
    """Each MXFP4 matrix's packed and scale bytes' addresses (``[M, 2]`` int64), the arrays
    (the caller keeps them referenced while a kernel reads them) and their packed bytes."""
    keep = []
    rows = []
    for w in ws:
        p = np.ascontiguousarray(w.packed, dtype=np.uint8)
        q = np.ascontiguousarray(w.scales, dtype=np.uint8)
        keep += [p, q]
        rows.append((p.ctypes.data, q.ctypes.data))
    return (np.array(rows, dtype=np.int64).reshape(-1, 2), keep,
            sum(k.nbytes for k in keep[0::2]))


class NumbaBackend(KernelBackend):
    """The kernel contract in Numba; ``threads`` defaults to every core Numba may use.

    ``parallel_grain``: bytes of work per thread below which a kernel runs on fewer threads
    (0 splits every kernel across all ``threads``; the tests use it to exercise the split;
    default :data:`OMP_GRAIN` under OpenMP, :data:`PARALLEL_GRAIN` under any other layer).
    ``force_parallel`` (default: ``K3_FORCE_PARALLEL``) is the same as a grain of 0 while it
    is on (:meth:`set_force_parallel`).
    """

    name = "numba"

    def __init__(
        self,
        threads: int | None = None,
        parallel_grain: int | None = None,
        force_parallel: bool | None = None,
    ) -> None:
        self._k = _kernels()
        if parallel_grain is None:
            self._k.numba.get_num_threads()  # loads the threading layer, so it can be named
            omp = self._k.numba.threading_layer() == "omp"
            parallel_grain = OMP_GRAIN if omp else PARALLEL_GRAIN
        self._grain = max(0, int(parallel_grain))
        self._forced = force_parallel_from_env() if force_parallel is None else bool(force_parallel)
        if not self._k.bits.subnormals_honoured():
            raise K3Error(
                "the numba backend needs IEEE subnormals, but denormals-are-zero is switched on "
                "in this process (a library built with -ffast-math?)",
                hint="use --backend numpy, or find the library that sets FTZ/DAZ",
            )
        self._max_threads = int(self._k.numba.config.NUMBA_NUM_THREADS)
        self._threads = 1
        self.set_threads(threads if threads is not None else self._max_threads)

    # --- threads ----------------------------------------------------------------------
    def set_threads(self, n: int) -> None:
        if int(n) < 1:
            raise ValueError(f"set_threads: need at least 1 thread, got {n}")
        self._threads = min(int(n), self._max_threads)

    @property
    def threads(self) -> int:
        return self._threads

    def set_force_parallel(self, on: bool) -> None:
        self._forced = bool(on)

    @property
    def parallel_forced(self) -> bool:
        return self._forced

    def _run(self, kernel: Any, work: int, *args: Any) -> None:
        """Launch ``kernel(*args)``. A parallel kernel (``Twins``) gets about one thread per
        ``parallel_grain`` bytes of ``work``, at most ``threads``; with one thread its serial
        build runs on the calling thread (no hand-off). Waking a worker costs more than a
        small kernel takes, and the split never changes a result (only independent outputs
        are divided between threads)."""
        if not isinstance(kernel, self._k.jit.Twins):
            kernel(*args)
            return
        if self._grain == 0 or self._forced:
            n = self._threads
        else:
            n = max(1, min(self._threads, work // self._grain))
        if n == 1:
            kernel.serial(*args)
            return
        with _LAUNCH:
            self._k.numba.set_num_threads(n)
            kernel.parallel(*args)

    # --- matrix products ---------------------------------------------------------------
    def _x(self, x: F32, cols: int) -> np.ndarray:
        x = _f32(x)
        if x.ndim != 2 or x.shape[1] != cols:
            raise ValueError(f"matmul: x has shape {x.shape}, weight has {cols} columns")
        return x

    def _dense(self, w: np.ndarray, x: F32) -> F32:
        w = _ro(np.ascontiguousarray(w))
        rows, cols = w.shape
        x = self._x(x, cols)
        T = x.shape[0]
        out = np.empty((T, rows), dtype=np.float32)
        if T == 0 or rows == 0:
            return out
        mm = self._k.matmul
        work = w.nbytes * -(-T // 4)
        if T == 1 and w.dtype == np.uint16 and cols % 32 == 0:  # pairs of bf16 (matmul.py)
            self._run(mm.bf16_t1_pairs, work, _ro(w.view(np.uint32)),
                      *_even_odd(x[0].astype(np.float64)), out[0])
        elif T == 1:
            self._run(mm.dense_t1, work, w, _ro(x[0].astype(np.float64)), out[0])
        else:
            ntile = -(-rows // 4)
            tiles = max(1, min(TILE_BYTES // (4 * cols * w.itemsize), ntile // (2 * self._threads)))
            self._run(mm.dense_t4, work, w, _ro(_widen_padded(x)), out, tiles)
        return out

    def matmul_bf16(self, w: U16, x: F32) -> F32:
        if w.dtype != np.uint16 or w.ndim != 2:
            raise ValueError(f"matmul_bf16: weight must be 2-D uint16 bf16 bits, got {w.dtype}")
        return self._dense(w, x)

    def matmul_f32(self, w: F32, x: F32) -> F32:
        if w.dtype != np.float32 or w.ndim != 2:
            raise ValueError(f"matmul_f32: weight must be 2-D float32, got {w.dtype}")
        return self._dense(w, x)

    def matmul_mxfp4(self, w: Mxfp4, x: F32) -> F32:
        packed = _ro(np.ascontiguousarray(w.packed, dtype=np.uint8))
        scales = _ro(np.ascontiguousarray(w.scales, dtype=np.uint8))
        rows, cols = w.shape
        if scales.shape != (rows, cols // 32) or cols % 32:
            raise ValueError(
                f"matmul_mxfp4: packed {packed.shape} / scales {scales.shape} do not describe a "
                f"[{rows}, {cols}] MXFP4 matrix"
            )
        x = self._x(x, cols)
        T = x.shape[0]
        out = np.empty((T, rows), dtype=np.float32)
        if T == 0 or rows == 0:
            return out
        xd = _widen_padded(x) if T > 1 else x.astype(np.float64)
        xe, xo = _even_odd(xd)
        mm = self._k.matmul
        work = 2 * packed.nbytes * -(-T // 4)
        if T == 1:
            self._run(mm.mxfp4_t1, work, packed, scales, xe[0], xo[0], out[0])
        else:
            self._run(mm.mxfp4_t4, work, packed, scales, xe, xo, out)
        return out

    def situ_mlp_many(
        self, mlps: Sequence[tuple[U16 | F32 | Mxfp4, U16 | F32 | Mxfp4, U16 | F32 | Mxfp4]],
        xs: Sequence[F32], b1: float, b2: float,
    ) -> list[F32]:
        """The routed experts of a layer. Where every expert is MXFP4 of one shape (and has
        at least one token), each stage's rows of every expert run in one parallel region
        (``numba_kernels/experts.py``: the W1 and W3 rows, one SiTU over all of them, the W2
        rows), each row the one-token kernel's when every expert has one token (a decode
        step) and the several-token kernel's pass otherwise (a prefill chunk, a batched
        step); anything else takes the separate calls. The bits are the separate calls'
        either way."""
        if len(mlps) != len(xs):
            raise ValueError(f"situ_mlp_many: {len(mlps)} MLPs but {len(xs)} inputs")
        shape = _grouped_mxfp4(mlps, xs)
        if shape is None:
            return super().situ_mlp_many(mlps, xs, b1, b2)
        inter, cols, out_rows = shape
        n = len(mlps)
        up = [w for w1, w3, _ in mlps for w in (w1, w3)]  # expert e's W1 at 2e, W3 at 2e + 1
        if all(x.shape[0] == 1 for x in xs):
            xd = np.concatenate([self._x(x, cols) for x in xs]).astype(np.float64)
            h = self._mx_rows(up, np.repeat(xd, 2, axis=0), inter, cols)
            a = self.situ_glu(np.ascontiguousarray(h[0::2]), np.ascontiguousarray(h[1::2]),
                              b1, b2)
            y = self._mx_rows([w2 for _, _, w2 in mlps], a.astype(np.float64), out_rows, inter)
            return [y[e : e + 1] for e in range(n)]
        counts = np.array([x.shape[0] for x in xs], dtype=np.int64)
        ooff = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        xd, xoff = _padded_blocks([self._x(x, cols) for x in xs])
        hs = self._mx_tokens(up, xd, np.repeat(xoff, 2), np.repeat(counts, 2),
                             np.tile(np.array([0, 1], dtype=np.int64), n), np.repeat(ooff, 2),
                             (2, int(counts.sum()), inter), inter, cols)
        a = self.situ_glu(hs[0], hs[1], b1, b2)
        ad, aoff = _padded_blocks([a[o : o + c] for o, c in zip(ooff.tolist(), counts.tolist(),
                                                                 strict=True)])
        y = self._mx_tokens([w2 for _, _, w2 in mlps], ad, aoff, counts,
                            np.zeros(n, dtype=np.int64), ooff, (1, int(counts.sum()), out_rows),
                            out_rows, inter)[0]
        return [y[o : o + c] for o, c in zip(ooff.tolist(), counts.tolist(), strict=True)]

    def _mx_rows(self, ws: list[Any], xd: np.ndarray, rows: int, cols: int) -> F32:
        """Row ``m`` of the result: MXFP4 matrix ``ws[m]`` ([rows x cols]) against token
        ``xd[m]`` (float64), every matrix's rows in one region."""
        addrs, keep, nbytes = _addresses(ws)
        out = np.empty((len(ws), rows), dtype=np.float32)
        # ``keep`` holds the packed and scale arrays until the kernel returns
        self._run(self._k.experts.mxfp4_t1_many, 2 * nbytes, _ro(addrs), rows, cols,
                  *_even_odd(xd), out)
        return out

    def _mx_tokens(self, ws: list[Any], xd: np.ndarray, xoff: np.ndarray, counts: np.ndarray,
                   which: np.ndarray, ooff: np.ndarray, shape: tuple[int, int, int], rows: int,
                   cols: int) -> F32:
        """``out[which[m], ooff[m] + t]``: MXFP4 matrix ``ws[m]`` ([rows x cols]) against its
        ``counts[m]`` tokens at rows ``xoff[m] ..`` of ``xd`` (float64, each matrix's tokens
        padded to a multiple of four), every matrix's rows in one region."""
        addrs, keep, _ = _addresses(ws)
        out = np.empty(shape, dtype=np.float32)  # ``keep`` is read by the kernel, as above
        work = sum(2 * k.nbytes * -(-int(c) // 4) for k, c in zip(keep[0::2], counts.tolist(),
                                                                 strict=True))
        self._run(self._k.experts.mxfp4_t4_many, work, _ro(addrs), rows, cols, *_even_odd(xd),
                  _ro(xoff), _ro(counts), _ro(which), _ro(ooff), out)
        return out

    # --- normalisation and activations ------------------------------------------------------
    def rmsnorm(self, x: F32, w: F32 | None, eps: float) -> F32:
        x = _f32(x)
        out = np.empty_like(x)
        if x.size:
            gain = _f32(w if w is not None else np.empty(0, dtype=np.float32))
            if w is not None and gain.shape != (x.shape[-1],):
                raise ValueError(f"rmsnorm: gain has shape {gain.shape}, x has {x.shape}")
            self._run(
                self._k.pointwise.rmsnorm_rows, 0, _rows(x), gain, w is not None, float(eps), _rows(out)
            )
        return out

    def l2norm(self, x: F32) -> F32:
        x = _f32(x)
        out = np.empty_like(x)
        if x.size:
            self._run(self._k.pointwise.l2norm_rows, 0, _rows(x), _rows(out))
        return out

    def _flat(self, kernel_name: str, x: F32) -> F32:
        x = _f32(x)
        out = np.empty_like(x)
        if x.size:
            self._run(getattr(self._k.pointwise, kernel_name), 0, x.reshape(-1), out.reshape(-1))
        return out

    def sigmoid(self, x: F32) -> F32:
        return self._flat("sigmoid_flat", x)

    def silu(self, x: F32) -> F32:
        return self._flat("silu_flat", x)

    def exp(self, x: F32) -> F32:
        return self._flat("exp_flat", x)

    def situ_glu(self, g: F32, u: F32, b1: float, b2: float) -> F32:
        g, u = _f32(g), _f32(u)
        if g.shape != u.shape:
            raise ValueError(f"situ_glu: gate {g.shape} and up {u.shape} differ")
        out = np.empty_like(g)
        if g.size:
            self._run(
                self._k.pointwise.situ_glu_flat,
                g.size * SITU_WORK,
                g.reshape(-1),
                u.reshape(-1),
                float(b1),
                float(b2),
                out.reshape(-1),
            )
        return out

    # --- attention building blocks -----------------------------------------------------------
    def shortconv(self, x: F32, w: F32, hist: F32) -> F32:
        x, w = _f32(x), _f32(w)
        T, C = x.shape
        K = w.shape[1]
        if w.shape[0] != C or hist.shape != (C, K - 1):
            raise ValueError(f"shortconv: x {x.shape}, w {w.shape}, hist {hist.shape} disagree")
        out = np.empty_like(x)
        if x.size:
            with _in_place(hist) as h:
                self._run(self._k.recurrent.shortconv_channels, 0, x, w, h, out)
        return out

    def kda_gate(self, z: F32, dt_bias: F32, a_log: F32, lower_bound: float) -> F32:
        z = _f32(z)
        dt, al = _f32(dt_bias).reshape(-1), _f32(a_log).reshape(-1)
        P = z.shape[-1]
        if dt.shape != (P,) or al.size == 0 or P % al.size:
            raise ValueError(f"kda_gate: z {z.shape}, dt_bias {dt.shape}, A_log {al.shape}")
        out = np.empty_like(z)
        if z.size:
            self._run(self._k.pointwise.kda_gate_rows, z.size * GATE_WORK, _rows(z), dt, al,
                      float(lower_bound), _rows(out))
        return out

    def kda_recurrent(self, q: F32, k: F32, v: F32, alpha: F32, beta: F32, state: F32) -> F32:
        q, k, v, alpha, beta = _f32(q), _f32(k), _f32(v), _f32(alpha), _f32(beta)
        T, H, D = q.shape
        if not (k.shape == v.shape == alpha.shape == q.shape) or beta.shape != (T, H):
            raise ValueError("kda_recurrent: q, k, v, alpha must be [T,H,D] and beta [T,H]")
        if state.shape != (H, D, D):
            raise ValueError(f"kda_recurrent: state has shape {state.shape}, expected {(H, D, D)}")
        out = np.empty_like(v)
        if T and H:
            with _in_place(state) as s:
                work = 16 * T * H * D * D
                self._run(self._k.recurrent.kda_heads, work, q, k, v, alpha, beta, s, out)
        return out

    def mla_attention(
        self, q: F32, k_nope: F32, k_rope: F32, v: F32, pos0: int, scale: float
    ) -> F32:
        q, k_nope, k_rope, v = _f32(q), _f32(k_nope), _f32(k_rope), _f32(v)
        T, H, _ = q.shape
        pos0 = int(pos0)
        if pos0 < 0 or min(k_nope.shape[0], k_rope.shape[0], v.shape[0]) < pos0 + T:
            raise ValueError(f"mla_attention: {T} queries at {pos0} need {pos0 + T} cached keys")
        out = np.empty((T, H, v.shape[2]), dtype=np.float32)
        if T and H:
            work = 8 * T * H * (pos0 + T) * (q.shape[2] + v.shape[2])
            self._run(
                self._k.attention.mla_heads, work, q, k_nope, k_rope, v, pos0, float(scale), out
            )
        return out

    def mla_latent_attention(
        self, q: F32, cache: F32, w_kvb: U16 | F32, pos0: int, scale: float
    ) -> F32:
        q, cache = _f32(q), _f32(cache)
        pos0 = int(pos0)
        T, H, n, C, r, dv = latent_shapes(q, cache, w_kvb, pos0)
        w = _ro(np.ascontiguousarray(w_kvb))
        out = np.empty((T, H, dv), dtype=np.float32)
        if T:
            work = 8 * T * H * ((pos0 + T) * (2 * C + r) + (n + dv) * C)
            self._run(self._k.attention.mla_latent_heads, work, q, cache, w, n, dv, pos0,
                      float(scale), out)
        return out

    def attn_res(self, sources: F32, fold: F32, eps: float) -> F32:
        src, fw = _f32(sources), _f32(fold).reshape(-1)
        S, T, E = src.shape
        if fw.shape != (E,) or S == 0:
            raise ValueError(f"attn_res: sources {src.shape}, fold {fw.shape}")
        out = np.empty((T, E), dtype=np.float32)
        if T and E:
            self._run(self._k.attention.attn_res_tokens, 0, src, fw, float(eps), out)
        return out

    def router(
        self, logits: F32, bias: F32, k: int, renorm: bool, scale: float
    ) -> tuple[np.ndarray, F32]:
        logits, b = _f32(logits), _f32(bias).reshape(-1)
        T, N = logits.shape
        if b.shape != (N,) or k < 1:
            raise ValueError(f"router: logits {logits.shape}, bias {b.shape}, k {k}")
        kk = min(int(k), N)
        idx = np.empty((T, kk), dtype=np.int64)
        w = np.empty((T, kk), dtype=np.float32)
        if T and kk:
            self._run(
                self._k.router.route_tokens,
                0,
                logits,
                b,
                int(k),
                bool(renorm),
                np.float32(scale),
                idx,
                w,
            )
        return idx, w


class _in_place:
    """Hand a kernel a float32 C-contiguous array it may update, writing back if it copied."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        ok = arr.dtype == np.float32 and arr.flags.c_contiguous and arr.flags.writeable
        self.work = arr if ok else np.ascontiguousarray(arr, dtype=np.float32)

    def __enter__(self) -> np.ndarray:
        return self.work

    def __exit__(self, *exc: object) -> None:
        if self.work is not self.arr and exc[0] is None:
            self.arr[...] = self.work


def _probe() -> Availability:
    """Cheap check: is Numba importable here?"""
    try:
        import numba  # noqa: F401
    except Exception as exc:  # ImportError, or a numba/numpy version clash at import
        return Availability.no(f"numba is not importable ({exc})", _INSTALL_HINT)
    return Availability.yes()


@hookimpl
def k3_kernel_backends() -> list[KernelBackendSpec]:
    return [
        KernelBackendSpec(
            name="numba",
            factory="k3_backends.numba_backend:NumbaBackend",
            description="Numba-compiled kernels, multi-threaded, bit-identical to numpy",
            priority=10,
            probe=_probe,
            install_hint=_INSTALL_HINT,
        )
    ]
