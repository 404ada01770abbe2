"""Kernel benchmark at the real Kimi K3 widths, for every available kernel backend.

``run_kernel_bench(backends, threads, repeat)`` times each op (median of ``repeat`` calls
after one warm-up call) for each backend, and measures the machine's memory read bandwidth
in the same run with the same thread count, so every matrix product can be reported as a
fraction of what the memory can deliver:

* ``GB/s`` is the op's input bytes read per second at the median time (weights for the
  matrix products, the recurrent state for ``kda_recurrent``, the cached keys and values
  for ``mla_attention``); the fastest call is reported too, since a busy machine inflates
  the median;
* ``of mem`` is that rate over the measured read bandwidth (measured before and after the
  ops; the higher is used).

Weights must come from memory, not from the last-level cache: an op whose inputs are
smaller than ``4 x LLC`` rotates through enough independent copies to exceed it (the way
the model streams different experts). Every backend gets the same inputs; a short digest
of each output is recorded and outputs that differ between backends are flagged (they
must not: the kernel contract is bit-exact).

Memory bandwidth: a read-reduction loop in C (the ``avx2`` backend's
``read_bandwidth_seconds``, the backend built through the registry: 256-bit loads, each
thread streaming its own slice) over a buffer of ``max(2^30 bytes, 8 x LLC)``, best of 5
passes. When that backend cannot run here, NumPy's single-threaded XOR reduction is used
instead and the result says so.

``python -m k3core.tools.bench.kernels [--backends avx2,numpy] [--threads N] [--repeat R] [--json]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.api.kernels import KernelBackend, Mxfp4
from k3core.api.units import human
from k3core.plugins.registry import get_registry

GiB = 1 << 30
MAX_COPIES = 64  # enough for every real-width case (the smallest, 5.8 MB, needs 22)
COLUMNS = ("backend", "op", "shape", "median ms", "best ms", "MB read", "GB/s", "of mem", "digest")


@dataclass
class OpTiming:
    """One op on one backend."""

    backend: str
    op: str
    shape: str
    seconds: float  # median
    best_seconds: float  # fastest call (a busy machine inflates the median)
    bytes_read: int
    gbps: float
    of_memory: float  # gbps / measured memory read bandwidth
    digest: str  # first 12 hex digits of sha256 over the output bytes
    matches: bool = True  # same digest as the first backend that ran this op
    macs: int = 0  # multiply-adds of a multi-token product (0: a bandwidth-bound op)


@dataclass
class BenchResult:
    """Everything one run measured; ``rows()`` for a table, ``to_json()`` for machines."""

    threads: int
    repeat: int
    memory_read_gbps: float  # the higher of the measurements before and after the ops
    memory_method: str
    memory_bytes: int
    llc_bytes: int
    timings: list[OpTiming] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why it did not run
    memory_samples_gbps: list[float] = field(default_factory=list)  # before, after
    fma_peak_gmacs: float = 0.0  # float64 FMA lanes per second, all threads (0: not measured)
    fma_method: str = ""
    #: MXFP4 weights multiplied by one token per second, all threads, by the backend's own
    #: one-token path in L1 (0: not measured): what a decoded weight costs (see
    #: ``measure_decode_peak``)
    decode_peak_gweights: float = 0.0
    decode_method: str = ""

    def rows(self) -> list[tuple[str, ...]]:
        """One tuple per timing, in :data:`COLUMNS` order, formatted for printing."""
        out: list[tuple[str, ...]] = []
        for t in self.timings:
            out.append(
                (
                    t.backend,
                    t.op,
                    t.shape,
                    f"{t.seconds * 1e3:.3f}",
                    f"{t.best_seconds * 1e3:.3f}",
                    f"{t.bytes_read / 1e6:.1f}",
                    f"{t.gbps:.2f}",
                    f"{100 * t.of_memory:.0f}%",
                    t.digest if t.matches else f"{t.digest} MISMATCH",
                )
            )
        return out

    def summary(self) -> str:
        lines = [
            f"memory read bandwidth: {self.memory_read_gbps:.2f} GB/s ({self.memory_method}, "
            f"{human(self.memory_bytes)} buffer, {self.threads} thread(s)); "
            f"LLC {human(self.llc_bytes)}; median of {self.repeat}"
        ]
        if self.fma_peak_gmacs:
            lines.append(f"float64 FMA peak: {self.fma_peak_gmacs:.1f} G multiply-adds/s "
                         f"({self.fma_method}, {self.threads} thread(s))")
            lines += [f"  {t.backend} {t.op} {t.shape}: {t.macs / t.seconds / 1e9:.1f} GMAC/s = "
                      f"{100 * t.macs / t.seconds / 1e9 / self.fma_peak_gmacs:.0f}% of it"
                      for t in self.timings if t.macs]
        if self.decode_peak_gweights:
            lines.append(f"MXFP4 decode ceiling: {self.decode_peak_gweights:.1f} G weights/s "
                         f"times one token ({self.decode_method}, {self.threads} thread(s))"
                         + (f"; a decoded weight costs {self.fma_peak_gmacs / self.decode_peak_gweights:.2f}"
                            " multiply-adds of the FMA peak" if self.fma_peak_gmacs else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --- the machine -------------------------------------------------------------------------------
def llc_bytes() -> int:
    """Size of the last-level cache (Linux sysfs), 2^25 bytes when unknown."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


def _ceilings(threads: int) -> Any:
    """The ``avx2`` kernel backend on ``threads`` threads, through the registry: it also
    measures the machine's ceilings (``read_bandwidth_seconds``, ``fma_peak_seconds``);
    ``None`` where it cannot run here."""
    reg = get_registry()
    if not reg.probe("kernel", "avx2").ok:
        return None
    try:
        backend, _, _ = reg.create("kernel", "avx2", threads=threads)
    except K3Error:
        return None
    return backend if hasattr(backend, "fma_peak_seconds") else None


def measure_read_bandwidth(threads: int, nbytes: int, passes: int = 5) -> tuple[float, str]:
    """Best-of-``passes`` read bandwidth in GB/s over ``nbytes``, and how it was measured."""
    nbytes -= nbytes % 128
    buf = np.empty(nbytes + 64, dtype=np.uint8)
    off = (-buf.ctypes.data) % 64
    view = buf[off : off + nbytes]
    view.fill(1)  # touch every page before timing
    view[::4096] = np.arange(view[::4096].size, dtype=np.uint8)
    ceilings = _ceilings(threads)
    if ceilings is None:
        words = view.view(np.uint64)
        best = float("inf")
        for _ in range(passes):
            t0 = time.perf_counter()
            np.bitwise_xor.reduce(words)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9, "NumPy XOR reduction, 1 thread (the avx2 backend cannot run here)"
    seconds = ceilings.read_bandwidth_seconds(view, passes)
    return nbytes / seconds / 1e9, "C 256-bit read loop (the avx2 backend's)"


def measure_fma_peak(threads: int, iters: int = 20_000_000, passes: int = 3) -> tuple[float, str]:
    """Float64 multiply-adds per second on ``threads`` threads (the products' compute ceiling
    under the kernel contract), and how; ``(0.0, why)`` without the avx2 backend."""
    ceilings = _ceilings(threads)
    if ceilings is None:
        return 0.0, "the avx2 backend cannot run here"
    seconds, lanes = ceilings.fma_peak_seconds(iters, passes)
    how = f"12 independent {64 * lanes}-bit FMA chains per thread (the avx2 backend's)"
    return threads * iters * 12 * lanes / seconds / 1e9, how


def measure_decode_peak(threads: int, iters: int = 20_000, passes: int = 3) -> tuple[float, str]:
    """MXFP4 weights multiplied by one token per second on ``threads`` threads, and how;
    ``(0.0, why)`` without the avx2 backend.

    The ceiling of a product whose weights are used once each (a decode step's routed
    experts, one row each): each thread runs the avx2 backend's own one-token path over an
    L1-resident block, so no memory traffic and no call overhead count, only turning packed
    weights into float64 lanes and their multiply-adds. Where the decode runs on the FMA
    pipes (Zen 4's table permutes do) this is well under the FMA peak, and a batched step's
    compute floor counts each weight it decodes at this rate and only its further tokens'
    multiply-adds at the FMA peak (``k3 bench decode --batch``)."""
    ceilings = _ceilings(threads)
    if ceilings is None or not hasattr(ceilings, "decode_peak_seconds"):
        return 0.0, "the avx2 backend cannot run here"
    seconds, weights = ceilings.decode_peak_seconds(iters, passes)
    how = "the avx2 backend's one-token MXFP4 path over a 16 x 1,024 block in L1"
    return threads * weights / seconds / 1e9, how


# --- the ops -----------------------------------------------------------------------------------
@dataclass
class Case:
    """An op at one shape: ``make(rng)`` builds one independent input set (a tuple of
    arguments), ``call(backend, args)`` runs it; ``nbytes`` are the input bytes it reads."""

    op: str
    shape: str
    make: Callable[[np.random.Generator], tuple[Any, ...]]
    call: Callable[[KernelBackend, tuple[Any, ...]], Any]
    nbytes: int
    macs: int = 0  # multiply-adds, for a compute-bound (multi-token) product


def _bf16(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def _x(rng: np.random.Generator, n: int, t: int = 1) -> np.ndarray:
    return rng.standard_normal((t, n), dtype=np.float32)


def _matvec_bf16(rows: int, cols: int, what: str) -> Case:
    return Case(
        f"matmul_bf16 ({what})",
        f"[{rows} x {cols}] x 1",
        lambda rng: (_bf16(rng, rows, cols), _x(rng, cols)),
        lambda b, a: b.matmul_bf16(a[0], a[1]),
        rows * cols * 2,
    )


def _prefill_bf16(rows: int, cols: int, tokens: int) -> Case:
    return Case(
        "matmul_bf16 (prefill)",
        f"[{rows} x {cols}] x {tokens}",
        lambda rng: (_bf16(rng, rows, cols), _x(rng, cols, tokens)),
        lambda b, a: b.matmul_bf16(a[0], a[1]),
        rows * cols * 2,
        rows * cols * tokens,
    )


def _matvec_mxfp4(rows: int, cols: int, what: str) -> Case:
    def make(rng: np.random.Generator) -> tuple[Any, ...]:
        packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scales = rng.integers(118, 126, (rows, cols // 32), dtype=np.uint8)
        return Mxfp4(packed, scales), _x(rng, cols)

    return Case(
        f"matmul_mxfp4 ({what})",
        f"[{rows} x {cols}] x 1",
        make,
        lambda b, a: b.matmul_mxfp4(a[0], a[1]),
        rows * cols // 2 + rows * cols // 32,
    )


def default_cases() -> list[Case]:
    """The real Kimi K3 widths (docs/model.md §1): E 7168, P 12288, Lt 3584, I 3072."""
    H, D, E = 96, 128, 7168
    mla_pos, n, r, dv, C = 1024, 128, 64, 128, 512

    def kda(rng: np.random.Generator) -> tuple[Any, ...]:
        q, k, v = (rng.standard_normal((1, H, D), dtype=np.float32) * 0.1 for _ in range(3))
        alpha = rng.uniform(0.9, 1.0, (1, H, D)).astype(np.float32)
        beta = rng.uniform(0.0, 1.0, (1, H)).astype(np.float32)
        return q, k, v, alpha, beta, rng.standard_normal((H, D, D), dtype=np.float32)

    def latent(rng: np.random.Generator) -> tuple[Any, ...]:
        q = rng.standard_normal((1, H, n + r), dtype=np.float32)
        cache = rng.standard_normal((mla_pos, C + r), dtype=np.float32)
        return q, cache, _bf16(rng, H * (n + dv), C)

    def mla(rng: np.random.Generator) -> tuple[Any, ...]:
        q = rng.standard_normal((1, H, n + r), dtype=np.float32)
        kn = rng.standard_normal((mla_pos, H, n), dtype=np.float32)
        kr = rng.standard_normal((mla_pos, r), dtype=np.float32)
        v = rng.standard_normal((mla_pos, H, dv), dtype=np.float32)
        return q, kn, kr, v

    return [
        _matvec_bf16(12288, 7168, "KDA q/k/v/g proj"),
        _matvec_bf16(7168, 12288, "o_proj"),
        _matvec_bf16(3584, 7168, "latent down"),
        _matvec_mxfp4(3072, 3584, "expert w1/w3"),
        _matvec_mxfp4(3584, 3072, "expert w2"),
        _prefill_bf16(1536, 7168, 20),
        Case(
            "rmsnorm",
            f"[1 x {E}]",
            lambda rng: (_x(rng, E), rng.standard_normal(E, dtype=np.float32)),
            lambda b, a: b.rmsnorm(a[0], a[1], 1e-5),
            E * 8,
        ),
        Case(
            "kda_recurrent",
            f"{H} x {D} x {D}, 1 token",
            kda,
            lambda b, a: b.kda_recurrent(*a),
            H * D * D * 4,
        ),
        Case(
            "mla_attention",
            f"{H} heads, {mla_pos} positions",
            mla,
            lambda b, a: b.mla_attention(a[0], a[1], a[2], a[3], mla_pos - 1, (n + r) ** -0.5),
            mla_pos * H * (n + dv) * 4 + mla_pos * r * 4,
        ),
        Case(
            "mla_latent_attention",
            f"{H} heads, {mla_pos} latent positions",
            latent,
            lambda b, a: b.mla_latent_attention(a[0], a[1], a[2], mla_pos - 1, (n + r) ** -0.5),
            mla_pos * (C + r) * 4 + H * (n + dv) * C * 2,
        ),
        Case(
            "router",
            "[1 x 896], top-16",
            lambda rng: (_x(rng, 896), rng.standard_normal(896, dtype=np.float32) * 0.01),
            lambda b, a: b.router(a[0], a[1], 16, True, 2.5),
            896 * 8,
        ),
    ]


def _digest(out: Any) -> str:
    h = hashlib.sha256()
    for part in out if isinstance(out, tuple) else (out,):
        h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()[:12]


def _create(name: str, threads: int) -> KernelBackend:
    backend, _, _ = get_registry().create("kernel", name)
    backend.set_threads(threads)
    return backend


def run_kernel_bench(
    backends: list[str],
    threads: int,
    repeat: int,
    *,
    cases: list[Case] | None = None,
    memory_bytes: int | None = None,
    seed: int = 0,
) -> BenchResult:
    """Time every case on every named backend (all available ones when ``backends`` is
    empty). A backend that cannot run here is listed in ``skipped`` with the reason."""
    if threads < 1 or repeat < 1:
        raise UsageError(f"bench: threads and repeat must be >= 1 (got {threads}, {repeat})")
    registry = get_registry()
    known = list(registry.names("kernel"))
    for n in backends:
        if n not in known:  # a typo is refused as everywhere else; one that cannot run here
            registry.resolve("kernel", n)  # is timed as skipped, with its reason, below
    names = list(backends) or [n for n in known if registry.probe("kernel", n).ok]
    llc = llc_bytes()
    mem_bytes = memory_bytes or max(GiB, 8 * llc)
    mem_gbps, method = measure_read_bandwidth(threads, mem_bytes)
    result = BenchResult(threads, repeat, mem_gbps, method, mem_bytes, llc)
    result.memory_samples_gbps.append(mem_gbps)
    live: dict[str, KernelBackend] = {}
    for name in names:
        try:
            live[name] = _create(name, threads)
        except K3Error as exc:
            result.skipped[name] = str(exc).replace("\n", " ")
    first: dict[str, str] = {}
    for case in cases if cases is not None else default_cases():
        copies = min(MAX_COPIES, max(1, -(-4 * llc // max(case.nbytes, 1))))
        rng = np.random.default_rng(seed)
        inputs = [case.make(rng) for _ in range(copies)]
        for name, backend in live.items():
            # warm-up and digest on a private copy: some ops update state in place
            fresh = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in inputs[0])
            out = case.call(backend, fresh)
            times = []
            for i in range(repeat):
                args = inputs[(i + 1) % copies]
                t0 = time.perf_counter()
                case.call(backend, args)
                times.append(time.perf_counter() - t0)
            sec = statistics.median(times)
            digest = _digest(out)
            key = f"{case.op} {case.shape}"
            first.setdefault(key, digest)
            result.timings.append(
                OpTiming(name, case.op, case.shape, sec, min(times), case.nbytes,
                         case.nbytes / sec / 1e9, 0.0, digest, digest == first[key], case.macs)
            )
        del inputs
    if result.timings:  # again after the ops: a busy machine's bandwidth drifts
        again, _ = measure_read_bandwidth(threads, mem_bytes)
        result.memory_samples_gbps.append(again)
        result.memory_read_gbps = max(result.memory_samples_gbps)
    for t in result.timings:
        t.of_memory = t.gbps / result.memory_read_gbps
    if any(t.macs for t in result.timings):
        result.fma_peak_gmacs, result.fma_method = measure_fma_peak(threads)
    if any("mxfp4" in t.op for t in result.timings):
        result.decode_peak_gweights, result.decode_method = measure_decode_peak(threads)
    return result


def format_table(result: BenchResult) -> str:
    rows = [COLUMNS, *result.rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(result.summary())
    lines += [f"skipped {name}: {why}" for name, why in result.skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3core.tools.bench.kernels", description=__doc__)
    ap.add_argument("--backends", default="", help="comma-separated names (default: all available)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        names = [n.strip() for n in args.backends.split(",") if n.strip()]
        result = run_kernel_bench(names, args.threads, args.repeat)
    except K3Error as exc:
        print(f"k3: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    print(result.to_json() if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
