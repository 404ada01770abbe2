"""The kernel conformance suite: a backend's outputs must equal the NumPy reference's bytes.

A kernel backend (built-in or third-party) proves conformance with one subclass::

    import pytest
    from k3.testing import KernelConformance

    class TestMine(KernelConformance):
        @pytest.fixture
        def backend(self):
            return MyBackend()

Every test calls one op on the backend and on :class:`k3_backends.numpy_backend.NumpyBackend`
with the same inputs and compares the results **by bits** (``float32`` outputs as ``uint32``
words, indices exactly), at awkward sizes, with edge values, at several thread counts
(``backend.set_threads``), and checks that inputs are left untouched except the documented
in-place state. The one tolerance: a NaN output must be NaN in both, but its sign and payload
are not compared (hardware NaN propagation is not part of the contract; see
``docs/kernel-contract.md``). ``test_adversarial`` adds inputs built to separate the
contract's lane sum from every other order and its ``exp`` from a library one
(:mod:`k3core.testing.adversarial`). The last tests run two 13-layer models generated in
memory (float32 weights; the released layout with bf16 trunk and MXFP4 experts) end to end
and compare their logits byte for byte (full recompute and incremental decoding), once more
at 1, 2 and 3 threads with every parallel path forced (``KernelBackend.set_force_parallel``),
since the small models would otherwise stay below every backend's threading threshold.
Nothing is read from disk: the suite runs the same from a wheel-installed k3.

The fused products (``matmul_many``, ``situ_mlp``, ``situ_mlp_many``) and layer parts
(``attn_res_norm``, ``kda_mix``, ``mla_mix``, ``moe_route``, ``moe_combine``) are compared with the reference's single
ops (a backend that does not fuse them inherits exactly those), and the
released-layout model once more with its prompt fed in chunks (``Model.prefill_chunk``).

Subclasses may override :attr:`KernelConformance.THREADS` and ``FORCED_THREADS``.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from k3core.api.kernels import KernelBackend, Mxfp4
from k3core.testing import adversarial
from k3core.testing.reference import reference
from k3core.testing.threads import thread_errors_fail

F32_EDGES = np.array(
    [
        0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38, 1.1754944e-38, 1e-30, -1e-8,
        0.25, 0.49999997, 0.5, -0.5, 1.0, -1.0, 11.0, 21.999998, 22.0, 22.000002, -22.000002,
        44.0, 88.0, -88.0, 88.72284, 89.0, -103.0, -104.0, -150.0, 708.0, -708.0, 708.5,
        -708.5, 709.0, -709.0, 710.0, -746.0, 1e4, -1e4, 1e30, -1e30, 3.4028235e38,
        -3.4028235e38, np.inf, -np.inf, np.nan,
    ],
    dtype=np.float32,
)
"""Float32 inputs that exercise every branch: signed zeros, subnormals, the transcendental
thresholds (TANH_SAT, EXP_HI/EXP_LO, float32 overflow/underflow of exp), huge values, inf, NaN."""

MATMUL_SHAPES = [  # (rows, cols, T): awkward widths, and the real ones with few rows
    (1, 1, 1), (3, 3, 3), (2, 31, 1), (5, 33, 3), (3, 64, 1), (4, 4097, 3),
    (3, 7168, 1), (2, 12288, 1), (2, 12288, 3), (3, 3584, 1), (2, 3072, 3),
]
MXFP4_SHAPES = [  # cols must be a multiple of the 32-column group
    (1, 32, 1), (3, 32, 3), (5, 96, 1), (4, 4096, 3), (3, 7168, 1), (3, 3072, 1),
    (2, 3584, 3), (2, 12288, 1),
]
WIDTHS = [1, 3, 31, 33, 4097]


# ---------------------------------------------------------------------------------------
# comparison and inputs


def _canon(a: np.ndarray) -> np.ndarray:
    """The array's raw words, with every NaN replaced by one quiet NaN pattern."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.float32:
        words = a.view(np.uint32).copy()
        words[np.isnan(a)] = 0x7FC00000
        return words
    if a.dtype == np.float64:
        words = a.view(np.uint64).copy()
        words[np.isnan(a)] = 0x7FF8000000000000
        return words
    return a


def assert_same_bits(got: Any, want: Any, what: str) -> None:
    """``got`` equals ``want`` in shape, dtype and bits (NaN compared as a class)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, reference {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    g, w = _canon(got), _canon(want)
    bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
    if bad.size:
        i = int(bad[0])
        gv, wv = got.reshape(-1)[i], want.reshape(-1)[i]
        where = tuple(int(j) for j in np.unravel_index(i, got.shape)) if got.ndim else ()
        raise AssertionError(
            f"{what}: {bad.size} of {got.size} elements differ from the numpy reference; "
            f"first at index {list(where)} (flat {i}): got {gv!r} (0x{int(g.reshape(-1)[i]):x}), "
            f"reference {wv!r} (0x{int(w.reshape(-1)[i]):x})"
        )


def _rng(*key: Any) -> np.random.Generator:
    """A generator seeded from the test's parameters (the same inputs in every run)."""
    return np.random.default_rng(zlib.crc32(repr(("k3-conformance",) + key).encode()))


#: The edge values a recurrence can absorb without turning its whole state into inf/NaN.
MILD_EDGES = F32_EDGES[np.isfinite(F32_EDGES) & (np.abs(F32_EDGES) <= 4.0)]


def activations(
    rng: np.random.Generator, shape: Sequence[int], scale: float = 1.0, mild: bool = False
) -> np.ndarray:
    """Random float32 values with a sprinkling of :data:`F32_EDGES` (NaN and inf excluded;
    only :data:`MILD_EDGES` when ``mild``)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    finite = MILD_EDGES if mild else F32_EDGES[np.isfinite(F32_EDGES)]
    flat = x.reshape(-1)
    if flat.size == 0:
        return x
    n = max(1, flat.size // 16)
    flat[rng.integers(0, flat.size, n)] = rng.choice(finite, n)
    return x


def edge_array(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """Every edge value (NaN and inf included) followed by ``n`` random ones."""
    return np.concatenate([F32_EDGES, (rng.standard_normal(n) * scale).astype(np.float32)])


def bf16_bits(rng: np.random.Generator, shape: Sequence[int], finite: bool) -> np.ndarray:
    """Random bf16 bit patterns: all 65536 possible (``finite=False``: inf and NaN too), or
    every finite one, with zero, subnormal and huge exponents over-represented."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    exp = (bits >> 7) & 0xFF
    if finite:
        bits = np.where(exp == 0xFF, bits & 0x807F, bits).astype(np.uint16)
    pick = rng.random(shape)
    bits = np.where(pick < 0.05, bits & 0x807F, bits)  # subnormals and signed zeros
    bits = np.where((pick > 0.97) & finite, (bits & 0x807F) | 0x7F00, bits)  # ~1e38
    return bits.astype(np.uint16)


def _snapshot(*arrays: Any) -> list[bytes]:
    out = []
    for a in arrays:
        if isinstance(a, Mxfp4):
            out.append(a.packed.tobytes() + a.scales.tobytes())
        else:
            out.append(np.asarray(a).tobytes())
    return out


def _check_unchanged(before: list[bytes], arrays: Sequence[Any], what: str) -> None:
    after = _snapshot(*arrays)
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if b == a:
            continue
        if len(b) != len(a):
            raise AssertionError(f"{what}: input {i} was modified: {len(b)} bytes became {len(a)}")
        x, y = np.frombuffer(b, np.uint8), np.frombuffer(a, np.uint8)
        bad = np.flatnonzero(x != y)
        j = int(bad[0])
        raise AssertionError(f"{what}: input {i} was modified (only the documented in-place "
                             f"state may be): {bad.size} of {x.size} bytes changed, first at byte "
                             f"{j}: 0x{int(x[j]):02x} -> 0x{int(y[j]):02x}")


def compare(
    backend: KernelBackend,
    op: str,
    *args: Any,
    inplace: Sequence[int] = (),
    what: str = "",
) -> Any:
    """Run ``op`` on the backend and the reference with copies of ``args``; compare bits.

    ``inplace`` lists argument positions the op may update (compared after the call); every
    other array argument must come back unchanged.
    """
    label = what if what.startswith(op) else f"{op} {what}".strip()
    mine = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    theirs = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    frozen = [
        i for i, a in enumerate(args) if isinstance(a, np.ndarray | Mxfp4) and i not in inplace
    ]
    before = _snapshot(*(mine[i] for i in frozen))
    with np.errstate(all="ignore"):
        got = getattr(backend, op)(*mine)
        want = getattr(reference(), op)(*theirs)
    _check_unchanged(before, [mine[i] for i in frozen], label)
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), (
            f"{label}: returned {type(got).__name__}"
            f"{f' of {len(got)}' if isinstance(got, tuple) else ''}, the reference a tuple of "
            f"{len(want)}")
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bits(g, w, f"{label} result {j}")
    else:
        assert_same_bits(got, want, label)
    for i in inplace:
        assert_same_bits(mine[i], theirs[i], f"{label} in-place argument {i}")
    return want


# ---------------------------------------------------------------------------------------
# the suite


class KernelConformance:
    """Bit-for-bit conformance of a kernel backend; subclasses provide ``backend``."""

    #: Thread counts every op is checked at (``backend.set_threads(n)``).
    THREADS: Sequence[int] = (1, 2)
    #: Thread counts of the whole-model runs with every parallel path forced.
    FORCED_THREADS: Sequence[int] = (1, 2, 3)

    @pytest.fixture(autouse=True)
    def _thread_errors_fail(self) -> Iterator[None]:
        """An exception in a thread the plugin started fails the test (never only a warning)."""
        with thread_errors_fail():
            yield

    @pytest.fixture
    def backend(self) -> KernelBackend:  # pragma: no cover - subclasses override
        raise NotImplementedError("a KernelConformance subclass must define a `backend` fixture")

    @pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
    def kb(self, request: Any, backend: KernelBackend) -> KernelBackend:
        """The backend under test, set to each thread count in turn."""
        n = request.param
        if n not in self.THREADS:
            pytest.skip(f"thread count {n} not in {type(self).__name__}.THREADS")
        backend.set_threads(n)
        return backend

    @contextlib.contextmanager
    def _forced(self, backend: KernelBackend, threads: int) -> Iterator[None]:
        """``backend`` at ``threads`` threads with every parallel path taken (skipped where
        the count is not in :attr:`FORCED_THREADS` or the backend cannot run that many), put
        back to one thread, unforced, afterwards."""
        if threads not in self.FORCED_THREADS:
            pytest.skip(f"thread count {threads} not in {type(self).__name__}.FORCED_THREADS")
        backend.set_threads(threads)
        if backend.threads < threads:
            pytest.skip(f"{backend.name} runs at most {backend.threads} threads in this process")
        backend.set_force_parallel(True)
        try:
            yield
        finally:
            backend.set_force_parallel(False)
            backend.set_threads(1)

    # --- interface ---------------------------------------------------------------------
    def test_is_a_kernel_backend(self, backend: KernelBackend) -> None:
        assert isinstance(backend, KernelBackend), (
            f"the backend is a {type(backend).__name__}, not a k3.plugin.KernelBackend")
        assert isinstance(backend.name, str) and backend.name, f"backend.name is {backend.name!r}"
        backend.set_threads(1)
        assert backend.threads >= 1, f"after set_threads(1), backend.threads is {backend.threads}"

    # --- matrix products -----------------------------------------------------------------
    @pytest.mark.parametrize("rows,cols,T", MATMUL_SHAPES)
    def test_matmul_bf16(self, kb: KernelBackend, rows: int, cols: int, T: int) -> None:
        rng = _rng("bf16", rows, cols, T)
        x = activations(rng, (T, cols))
        compare(kb, "matmul_bf16", bf16_bits(rng, (rows, cols), finite=True), x)
        compare(kb, "matmul", bf16_bits(rng, (rows, cols), finite=True), x, what="matmul(bf16)")

    def test_matmul_bf16_every_bit_pattern(self, kb: KernelBackend) -> None:
        """All 65536 bf16 patterns (subnormals, inf and NaN included) as one 256x256 matrix,
        row-major and transposed, and random patterns at awkward widths."""
        rng = _rng("bf16-all")
        every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
        x = activations(rng, (3, 256))
        compare(kb, "matmul_bf16", every, x)
        compare(kb, "matmul_bf16", np.ascontiguousarray(every.T), x, what="bf16 transposed")
        for cols in (1, 3, 33):
            w = bf16_bits(rng, (64, cols), finite=False)
            compare(kb, "matmul_bf16", w, activations(rng, (3, cols)), what=f"bf16 {cols} cols")

    @pytest.mark.parametrize("rows,cols,T", MATMUL_SHAPES)
    def test_matmul_f32(self, kb: KernelBackend, rows: int, cols: int, T: int) -> None:
        rng = _rng("f32", rows, cols, T)
        w = activations(rng, (rows, cols), scale=0.05)
        x = activations(rng, (T, cols))
        compare(kb, "matmul_f32", w, x)
        compare(kb, "matmul", w, x, what="matmul(f32)")

    def test_matmul_overflow_and_nan_inputs(self, kb: KernelBackend) -> None:
        rng = _rng("mm-edge")
        x = np.resize(F32_EDGES, (3, 45)).astype(np.float32)
        compare(kb, "matmul_f32", activations(rng, (7, 45)), x)
        compare(kb, "matmul_bf16", bf16_bits(rng, (7, 45), finite=True), x)

    @pytest.mark.parametrize("rows,cols,T", MXFP4_SHAPES)
    def test_matmul_mxfp4(self, kb: KernelBackend, rows: int, cols: int, T: int) -> None:
        rng = _rng("mxfp4", rows, cols, T)
        packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        scales = rng.integers(100, 140, (rows, cols // 32), dtype=np.uint8)
        special = np.array([0, 1, 127, 128, 200, 253, 254, 255], dtype=np.uint8)
        scales.reshape(-1)[: special.size] = special[: scales.size]
        w = Mxfp4(packed, scales)
        x = activations(rng, (T, cols))
        compare(kb, "matmul_mxfp4", w, x)
        compare(kb, "matmul", w, x, what="matmul(mxfp4)")

    def test_mxfp4_scale_bytes(self, kb: KernelBackend) -> None:
        """Every scale byte 0..255 (255 = NaN by OCP, zero here) and every nibble code."""
        codes = np.arange(256, dtype=np.uint8)
        packed = np.tile(np.resize(codes, 16), (256, 1))  # each row: bytes 0x00..0x0F
        packed[1::2] = np.resize(codes[::17], 16)  # odd rows: 0x00, 0x11, ..., 0xFF
        scales = np.arange(256, dtype=np.uint8).reshape(256, 1)
        x = activations(_rng("mx-scales"), (3, 32))
        want = compare(kb, "matmul_mxfp4", Mxfp4(packed, scales), x)
        assert np.all(want[:, 255] == 0.0), "scale byte 255 must contribute exactly zero"

    # --- fused products (defaults compose the single ops; a backend may fuse them) ------------
    @staticmethod
    def _mx(rng: np.random.Generator, rows: int, cols: int) -> Mxfp4:
        return Mxfp4(rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                     rng.integers(100, 140, (rows, cols // 32), dtype=np.uint8))

    @pytest.mark.parametrize("T", [1, 3, 6])
    def test_matmul_many(self, kb: KernelBackend, T: int) -> None:
        """Several matrices (mixed kinds, row counts, a group of one) over the same x equal
        the reference's single products; no input is modified."""
        rng = _rng("many", T)
        x = activations(rng, (T, 96))
        ws: list[Any] = [bf16_bits(rng, (5, 96), finite=True), bf16_bits(rng, (33, 96), finite=True),
              activations(rng, (3, 96), scale=0.05), self._mx(rng, 7, 96), self._mx(rng, 2, 96),
              bf16_bits(rng, (1, 96), finite=True)]
        before = _snapshot(x, *ws)
        with np.errstate(all="ignore"):
            got = kb.matmul_many(ws, x)
            want = [reference().matmul(w, x) for w in ws]
        _check_unchanged(before, [x, *ws], "matmul_many")
        assert len(got) == len(want), f"matmul_many: {len(got)} results for {len(want)} matrices"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bits(g, w, f"matmul_many result {i}")

    @pytest.mark.parametrize("cols", [45, 96])
    @pytest.mark.parametrize("T", [1, 3])
    def test_matmul_many_bf16(self, kb: KernelBackend, cols: int, T: int) -> None:
        """A group of bf16 matrices only (the projections that share a token: a backend may
        take every matrix's rows in one region), row counts odd, even and one, a width with
        a lane tail, special activations: the reference's single products."""
        rng = _rng("many-bf16", cols, T)
        x = activations(rng, (T, cols))
        ws: list[Any] = [bf16_bits(rng, (r, cols), finite=True) for r in (5, 33, 1, 64, 2)]
        with np.errstate(all="ignore"):
            got = kb.matmul_many(ws, x)
            want = [reference().matmul(w, x) for w in ws]
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bits(g, w, f"matmul_many bf16 result {i}")

    @pytest.mark.parametrize("kind", ["bf16", "f32", "mxfp4"])
    @pytest.mark.parametrize("T", [1, 3, 6])
    def test_situ_mlp(self, kb: KernelBackend, kind: str, T: int) -> None:
        """``situ_mlp`` equals ``matmul(w2, situ_glu(matmul(w1, x), matmul(w3, x)))`` bit for
        bit, at awkward widths and with gate values that saturate tanh and sigmoid."""
        rng = _rng("situ-mlp", kind, T)
        cols, inter, out = (96, 64, 40) if kind == "mxfp4" else (45, 33, 7)

        def w(rows: int, c: int) -> Any:
            if kind == "mxfp4":
                return self._mx(rng, rows, c)
            if kind == "bf16":
                return bf16_bits(rng, (rows, c), finite=True)
            return activations(rng, (rows, c), scale=0.3)

        w1, w3, w2 = w(inter, cols), w(inter, cols), w(out, inter)
        x = activations(rng, (T, cols), scale=3.0)
        before = _snapshot(x, w1, w3, w2)
        with np.errstate(all="ignore"):
            got = kb.situ_mlp(w1, w3, w2, x, 4.0, 25.0)
            r = reference()
            want = r.matmul(w2, r.situ_glu(r.matmul(w1, x), r.matmul(w3, x), 4.0, 25.0))
        _check_unchanged(before, [x, w1, w3, w2], "situ_mlp")
        assert_same_bits(got, want, f"situ_mlp {kind}")

    def _situ_many_case(self, kind: str, Ts: Sequence[int]) -> tuple[list[tuple[Any, Any, Any]], list[Any]]:
        rng = _rng("situ-many", kind, *Ts)
        cols, inter, out = (96, 64, 40) if kind == "mxfp4" else (45, 33, 7)

        def w(rows: int, c: int) -> Any:
            if kind == "mxfp4":
                return self._mx(rng, rows, c)
            if kind == "bf16":
                return bf16_bits(rng, (rows, c), finite=True)
            return activations(rng, (rows, c), scale=0.3)

        mlps = [(w(inter, cols), w(inter, cols), w(out, inter)) for _ in Ts]
        xs = [activations(rng, (t, cols), scale=3.0) for t in Ts]
        return mlps, xs

    def _check_situ_many(self, kb: KernelBackend, kind: str, Ts: Sequence[int]) -> None:
        mlps, xs = self._situ_many_case(kind, Ts)
        before = _snapshot(*xs, *(w for mlp in mlps for w in mlp))
        with np.errstate(all="ignore"):
            got = kb.situ_mlp_many(mlps, xs, 4.0, 25.0)
            want = [reference().situ_mlp(w1, w3, w2, x, 4.0, 25.0)
                    for (w1, w3, w2), x in zip(mlps, xs, strict=True)]
        _check_unchanged(before, [*xs, *(w for mlp in mlps for w in mlp)], "situ_mlp_many")
        assert len(got) == len(want), f"situ_mlp_many {kind}: {len(got)} results for {len(want)} MLPs"
        for i, (g, ww) in enumerate(zip(got, want, strict=True)):
            assert g.shape == ww.shape, f"situ_mlp_many {kind} result {i}: shape {g.shape}"
            assert_same_bits(g, ww, f"situ_mlp_many {kind} result {i} ({Ts[i]} tokens)")

    #: tokens per MLP of the grouped calls: none, one, a few, more than a register block, and
    #: a decode step's (every MLP one token: a backend may group those, as numba does)
    SITU_MANY_TOKENS: Sequence[Sequence[int]] = ((1,), (3, 0, 1, 7), (2, 5, 13, 4, 1, 6),
                                                 (1, 1, 1, 1, 1))

    @pytest.mark.parametrize("kind", ["bf16", "f32", "mxfp4"])
    @pytest.mark.parametrize("case", range(4), ids=lambda i: f"case{i}")
    def test_situ_mlp_many(self, kb: KernelBackend, kind: str, case: int) -> None:
        """``situ_mlp_many`` (the routed experts of a layer, each over its own rows) equals one
        reference ``situ_mlp`` per MLP bit for bit; an MLP with no rows gives ``[0, out]``."""
        self._check_situ_many(kb, kind, self.SITU_MANY_TOKENS[case])

    @pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
    @pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
    def test_situ_mlp_many_parallel_forced(self, backend: KernelBackend, threads: int,
                                           kind: str) -> None:
        """The grouped experts with every parallel path taken, at 1, 2 and 3 threads."""
        with self._forced(backend, threads):
            for Ts in self.SITU_MANY_TOKENS:
                self._check_situ_many(backend, kind, Ts)

    def test_situ_mlp_many_refuses_mismatched_inputs(self, backend: KernelBackend) -> None:
        mlps, xs = self._situ_many_case("f32", (2, 3))
        with pytest.raises(ValueError, match="situ_mlp_many"):
            backend.situ_mlp_many(mlps, xs[:1], 4.0, 25.0)

    # --- fused layer parts (defaults compose the single ops; a backend may fuse them) ---------
    @pytest.mark.parametrize("S,T,E", [(1, 1, 33), (3, 3, 45), (9, 2, 4097)])
    def test_attn_res_norm(self, kb: KernelBackend, S: int, T: int, E: int) -> None:
        """``attn_res_norm`` is ``rmsnorm(attn_res(...))`` of the reference's single ops."""
        rng = _rng("ares-norm", S, T, E)
        src = activations(rng, (S, T, E), scale=2.0)
        fold, w = activations(rng, (E,)), activations(rng, (E,))
        with np.errstate(all="ignore"):
            got = kb.attn_res_norm(src, fold, w, 1e-5)
            r = reference()
            want = r.rmsnorm(r.attn_res(src, fold, 1e-5), w, 1e-5)
        assert_same_bits(got, want, "attn_res_norm")

    @staticmethod
    def _kda_case(kind: str, H: int, D: int, rows: Sequence[int]) -> tuple[Any, Any, Any]:
        """A KDA layer's weights of ``kind`` (or ``mixed``: the projections bf16, the rest
        float32), an input of ``sum(rows)`` rows and one state per sequence."""
        from k3core.api.kernels import KdaSeq, KdaWeights

        rng = _rng("kda-mix", kind, H, D, *rows)
        E, K, P = 45, 4, H * D

        def w(r: int, c: int, main: bool = True) -> Any:
            if kind == "bf16" or (kind == "mixed" and main):
                return bf16_bits(rng, (r, c), finite=True) & np.uint16(0xBFFF)  # |w| < 2
            return activations(rng, (r, c), scale=0.3, mild=True)

        wts = KdaWeights(
            proj=(w(P, E), w(P, E), w(P, E), w(H, E), w(D, E), w(P, E)), f_b=w(P, D, False),
            dt_bias=activations(rng, (P,), mild=True), a_log=activations(rng, (H,), mild=True),
            conv=tuple(activations(rng, (P, K), mild=True) for _ in range(3)),  # type: ignore[arg-type]
            o_norm=activations(rng, (D,), mild=True), o_proj=w(E, P, False), lower_bound=-5.0,
            q_scale=float(np.float32(1 / np.sqrt(D))), eps=1e-5)
        x = activations(rng, (sum(rows), E), mild=True)
        seqs = [KdaSeq(n, tuple(activations(rng, (P, K - 1), mild=True) for _ in range(3)),  # type: ignore[arg-type]
                       activations(rng, (H, D, D), scale=0.2, mild=True)) for n in rows]
        return wts, x, seqs

    @pytest.mark.parametrize("kind", ["bf16", "f32", "mixed"])
    @pytest.mark.parametrize("H,D,rows", [(2, 3, (1,)), (4, 16, (3,)), (4, 16, (1, 2, 1)),
                                          (3, 33, (2, 1))])
    def test_kda_mix(self, kb: KernelBackend, kind: str, H: int, D: int,
                     rows: tuple[int, ...]) -> None:
        """``kda_mix`` (a KDA layer's mixer over several sequences) equals the reference's
        single ops bit for bit, output and every sequence's histories and state, over two
        steps that carry the state; the weights and the input are left untouched."""
        import copy

        wts, _, seqs = self._kda_case(kind, H, D, rows)
        mine, theirs = copy.deepcopy(seqs), copy.deepcopy(seqs)
        for step in range(2):
            x = self._kda_case(kind, H, D, rows)[1] * np.float32(step + 1)
            before = _snapshot(x, *wts.proj, wts.f_b, wts.o_proj, *wts.conv)
            with np.errstate(all="ignore"):
                got = kb.kda_mix(x, wts, mine)
                want = reference().kda_mix(x, wts, theirs)
            _check_unchanged(before, [x, *wts.proj, wts.f_b, wts.o_proj, *wts.conv], "kda_mix")
            assert_same_bits(got, want, f"kda_mix {kind} step {step}")
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                assert_same_bits(a.state, b.state, f"kda_mix {kind} step {step} state {i}")
                for j in range(3):
                    assert_same_bits(a.hist[j], b.hist[j], f"kda_mix {kind} step {step} "
                                     f"history {'qkv'[j]} of sequence {i}")

    def test_kda_mix_refuses_rows_that_do_not_add_up(self, backend: KernelBackend) -> None:
        wts, x, seqs = self._kda_case("bf16", 2, 3, (2, 1))
        with pytest.raises(ValueError, match="kda_mix"):
            backend.kda_mix(x, wts, seqs[:1])

    @pytest.mark.parametrize("kind", ["bf16", "f32", "mxfp4"])
    @pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (3, 5)])
    @pytest.mark.parametrize("norm,shared", [(True, True), (False, False), (True, False)])
    def test_moe_combine(self, kb: KernelBackend, kind: str, T: int, k: int, norm: bool,
                         shared: bool) -> None:
        """``moe_combine`` (the routed sum, the latent norm, the up-projection, the shared
        experts added) equals the reference's slot-by-slot sum and single ops bit for bit."""
        rng = _rng("moe-combine", kind, T, k, norm, shared)
        lat, E = 64, 45
        up: Any = (self._mx(rng, E, lat) if kind == "mxfp4" else
                   bf16_bits(rng, (E, lat), finite=True) if kind == "bf16" else
                   activations(rng, (E, lat), scale=0.3))
        w = activations(rng, (T, k), mild=True)
        outs = activations(rng, (T, k, lat), scale=2.0)
        g = activations(rng, (lat,)) if norm else None
        sh = activations(rng, (T, E)) if shared else None
        with np.errstate(all="ignore"):
            got = kb.moe_combine(w, outs, g, 1e-5, up, sh)
            r = reference()
            acc = np.zeros((T, lat), dtype=np.float32)
            for j in range(k):
                acc += w[:, j : j + 1] * outs[:, j]
            if g is not None:
                acc = r.rmsnorm(acc, g, 1e-5)
            want = r.matmul(up, acc)
            if sh is not None:
                want = want + sh
        assert_same_bits(got, want, f"moe_combine {kind}")

    #: (rows, positions before, rows attending) of each sequence of an ``mla_mix`` call: one
    #: decode row, a prompt, a batched step, a pass's last layer (only the asked rows attend),
    #: a chunk before it (none attend)
    MLA_SEQS: Sequence[Sequence[tuple[int, int, int]]] = (
        ((1, 5, 1),), ((3, 0, 3),), ((1, 4, 1), (2, 0, 2), (1, 9, 1)), ((3, 2, 1), (2, 0, 1)),
        ((2, 0, 0),))

    @staticmethod
    def _mla_case(kind: str, gated: bool, seqs: Sequence[tuple[int, int, int]]
                  ) -> tuple[Any, Any, list[Any]]:
        from k3core.api.kernels import MlaSeq, MlaWeights

        rng = _rng("mla-mix", kind, gated, *seqs)
        E, QL, C, r, H, n, dv = 45, 24, 32, 8, 3, 16, 12

        def w(rows: int, c: int) -> Any:
            if kind == "bf16":
                return bf16_bits(rng, (rows, c), finite=True) & np.uint16(0xBFFF)
            return activations(rng, (rows, c), scale=0.3, mild=True)

        wts = MlaWeights(q_a=w(QL, E), kv_a=w(C + r, E), gate=w(H * dv, E) if gated else None,
                         q_a_norm=activations(rng, (QL,), mild=True),
                         kv_a_norm=activations(rng, (C,), mild=True), q_b=w(H * (n + r), QL),
                         kv_b=w(H * (n + dv), C), o_proj=w(E, H * dv), kv_lora=C, heads=H,
                         scale=1 / np.sqrt(n + r), eps=1e-5)
        x = activations(rng, (sum(s[0] for s in seqs), E), mild=True)
        out = [MlaSeq(rows, activations(rng, (pos + rows + 2, C + r), mild=True), pos, att)
               for rows, pos, att in seqs]
        return wts, x, out

    @pytest.mark.parametrize("kind", ["bf16", "f32"])
    @pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
    @pytest.mark.parametrize("case", range(5), ids=lambda i: f"case{i}")
    def test_mla_mix(self, kb: KernelBackend, kind: str, gated: bool, case: int) -> None:
        """``mla_mix`` (an MLA layer over several sequences: every row's latent to its cache,
        the attending rows' queries, attention, gate and output) equals the reference's
        single ops bit for bit, output and caches; the weights and input are untouched."""
        import copy

        wts, x, seqs = self._mla_case(kind, gated, self.MLA_SEQS[case])
        mine, theirs = copy.deepcopy(seqs), copy.deepcopy(seqs)
        mats = [wts.q_a, wts.kv_a, wts.q_b, wts.kv_b, wts.o_proj] + ([wts.gate] if gated else [])
        before = _snapshot(x, *mats)
        with np.errstate(all="ignore"):
            got = kb.mla_mix(x, wts, mine)
            want = reference().mla_mix(x, wts, theirs)
        _check_unchanged(before, [x, *mats], "mla_mix")
        assert_same_bits(got, want, f"mla_mix {kind} case {case}")
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_same_bits(a.cache, b.cache, f"mla_mix {kind} case {case} cache {i}")

    def test_mla_mix_refuses_rows_that_do_not_add_up(self, backend: KernelBackend) -> None:
        wts, x, seqs = self._mla_case("f32", True, self.MLA_SEQS[2])
        with pytest.raises(ValueError, match="mla_mix"):
            backend.mla_mix(x, wts, seqs[:1])

    @pytest.mark.parametrize("kind", ["bf16", "f32", "mxfp4", "mixed"])
    @pytest.mark.parametrize("S,T,N,k", [(1, 1, 8, 2), (3, 3, 64, 8), (2, 2, 5, 5), (2, 1, 7, 9)])
    def test_moe_route(self, kb: KernelBackend, kind: str, S: int, T: int, N: int, k: int) -> None:
        """``moe_route`` (the block's input, the router's logits and latent down-projection in
        one product, the router's choice) equals the reference's single ops: ids exactly,
        every float by bits; ``mixed`` (a bf16 gate, a float32 down-projection) too."""
        rng = _rng("moe-route", kind, S, T, N, k)
        E, lat = 64, 40

        def w(rows: int, kd: str) -> Any:
            if kd == "mxfp4":
                return self._mx(rng, rows, E)
            if kd == "bf16":
                return bf16_bits(rng, (rows, E), finite=True)
            return activations(rng, (rows, E), scale=0.3)

        gate = w(N, "bf16" if kind == "mixed" else kind)
        down = w(lat, "f32" if kind == "mixed" else kind)
        src = activations(rng, (S, T, E), scale=2.0)
        fold, norm, bias = (activations(rng, (E,)), activations(rng, (E,)),
                            activations(rng, (N,), scale=0.1))
        with np.errstate(all="ignore"):
            got = kb.moe_route(src, fold, norm, 1e-5, gate, down, bias, k, True, 2.5)
            r = reference()
            xn = r.rmsnorm(r.attn_res(src, fold, 1e-5), norm, 1e-5)
            idx, ww = r.router(r.matmul(gate, xn), bias, k, True, 2.5)
            want = (xn, idx, ww, r.matmul(down, xn))
        assert len(got) == 4, f"moe_route returned {len(got)} results, not (xn, idx, w, z)"
        for name, g, x in zip(("xn", "idx", "w", "z"), got, want, strict=True):
            assert_same_bits(g, x, f"moe_route {kind} {name}")

    @pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
    def test_fused_parts_parallel_forced(self, backend: KernelBackend, threads: int) -> None:
        """The fused layer parts with every parallel path taken, at 1, 2 and 3 threads."""
        with self._forced(backend, threads):
            self.test_kda_mix(backend, "bf16", 4, 16, (1, 2, 1))
            self.test_moe_combine(backend, "mxfp4", 3, 5, True, True)
            self.test_attn_res_norm(backend, 9, 2, 4097)
            self.test_moe_route(backend, "bf16", 3, 3, 64, 8)
            for case in range(len(self.MLA_SEQS)):
                self.test_mla_mix(backend, "bf16", True, case)

    # --- normalisation and activations ------------------------------------------------------
    @pytest.mark.parametrize("m", WIDTHS + [7168])
    @pytest.mark.parametrize("T", [1, 3])
    def test_rmsnorm(self, kb: KernelBackend, m: int, T: int) -> None:
        rng = _rng("rms", m, T)
        x = activations(rng, (T, m), scale=3.0)
        x[0, : min(m, 3)] = 0.0
        if T > 1:
            x[1] = 0.0  # an all-zero row: inv = 1/sqrt(eps)
            x[2] = np.float32(3e37)  # squares near 1e75 stay finite in float64
        gain = activations(rng, (m,))
        compare(kb, "rmsnorm", x, gain, 1e-6)
        compare(kb, "rmsnorm", x, None, 1e-5, what="rmsnorm without gain")
        compare(kb, "rmsnorm", x.reshape(T, 1, m), gain, 1e-6, what="rmsnorm 3-D")

    @pytest.mark.parametrize("D", [1, 3, 16, 33, 128])
    def test_l2norm(self, kb: KernelBackend, D: int) -> None:
        rng = _rng("l2", D)
        x = activations(rng, (3, 4, D))
        x[0, 0] = 0.0
        x[1, 1] = np.float32(1e-40)
        compare(kb, "l2norm", x)

    @pytest.mark.parametrize("op", ["sigmoid", "silu", "exp"])
    @pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
    def test_activations(self, kb: KernelBackend, op: str, scale: float) -> None:
        rng = _rng(op, scale)
        x = edge_array(rng, 4097, scale)
        compare(kb, op, x)
        compare(kb, op, x[: 3 * 33].reshape(3, 33), what=f"{op} 2-D")
        compare(kb, op, x[:1], what=f"{op} single")

    @pytest.mark.parametrize("b1,b2", [(4.0, 25.0), (1.0, 1.0), (0.5, 3.0)])
    def test_situ_glu(self, kb: KernelBackend, b1: float, b2: float) -> None:
        rng = _rng("situ", b1, b2)
        g = edge_array(rng, 4097, 10.0)
        u = np.roll(edge_array(rng, 4097, 30.0), 7)
        compare(kb, "situ_glu", g, u, b1, b2)
        compare(kb, "situ_glu", g[:99].reshape(3, 33), u[:99].reshape(3, 33), b1, b2, what="2-D")

    # --- attention building blocks ------------------------------------------------------------
    @pytest.mark.parametrize("C", [1, 3, 33, 300])
    @pytest.mark.parametrize("K", [1, 2, 4])
    @pytest.mark.parametrize("T", [1, 3])
    def test_shortconv_state_in_place(self, kb: KernelBackend, C: int, K: int, T: int) -> None:
        rng = _rng("conv", C, K, T)
        w = activations(rng, (C, K))
        hist = activations(rng, (C, K - 1))
        for step in range(2):  # the carried history must keep agreeing
            x = activations(rng, (T, C), scale=4.0)
            compare(kb, "shortconv", x, w, hist, inplace=(2,), what=f"shortconv step {step}")
            with np.errstate(all="ignore"):
                reference().shortconv(x, w, hist)  # advance the carried history

    @pytest.mark.parametrize("H,D", [(1, 1), (2, 3), (4, 16), (3, 33)])
    @pytest.mark.parametrize("T", [1, 3])
    def test_kda_gate(self, kb: KernelBackend, H: int, D: int, T: int) -> None:
        rng = _rng("gate", H, D, T)
        z = activations(rng, (T, H * D), scale=3.0)
        dt = activations(rng, (H * D,))
        a_log = activations(rng, (H,))
        compare(kb, "kda_gate", z, dt, a_log, -5.0)
        compare(kb, "kda_gate", z, dt, a_log, -0.5, what="kda_gate lb=-0.5")

    def test_kda_gate_saturates_to_one(self, kb: KernelBackend) -> None:
        """A large A_log with a very negative gate input makes sig_d 0, alpha exactly 1.0;
        a very negative A_log makes exp_d(A_log) 0 and alpha = exp_d(lb / 2)."""
        z = np.array([[-100.0, -1e6, 5.0, 0.0, -0.0, 1e30]], dtype=np.float32)
        dt = np.zeros(6, dtype=np.float32)
        for a_log in ([10.0, 10.0], [-800.0, 3.0], [89.0, -89.0]):
            al = np.array(a_log, dtype=np.float32)
            want = compare(kb, "kda_gate", z, dt, al, -5.0, what=f"kda_gate A_log={a_log}")
            if a_log[0] == 10.0:
                assert want[0, 0] == 1.0 and want[0, 1] == 1.0, (
                f"kda_gate A_log={a_log}: the reference's alpha is {want[0, :2]}, not saturated at 1")

    @pytest.mark.parametrize("H,D", [(1, 1), (2, 3), (4, 16), (2, 33)])
    @pytest.mark.parametrize("T", [1, 3])
    def test_kda_recurrent_state_in_place(self, kb: KernelBackend, H: int, D: int, T: int) -> None:
        rng = _rng("kda", H, D, T)
        S = activations(rng, (H, D, D), scale=0.5, mild=True)
        for step in range(2):
            q = activations(rng, (T, H, D), mild=True)
            k = activations(rng, (T, H, D), scale=0.3, mild=True)
            v = activations(rng, (T, H, D), mild=True)
            alpha = np.exp(-np.abs(activations(rng, (T, H, D), mild=True))).astype(np.float32)
            alpha.reshape(-1)[0] = 1.0
            alpha.reshape(-1)[-1] = 0.0
            beta = (1.0 / (1.0 + np.exp(-activations(rng, (T, H), mild=True)))).astype(np.float32)
            compare(kb, "kda_recurrent", q, k, v, alpha, beta, S, inplace=(5,), what=f"kda step {step}")
            with np.errstate(all="ignore"):
                reference().kda_recurrent(q, k, v, alpha, beta, S)  # advance the state

    @pytest.mark.parametrize("n,r,dv", [(24, 8, 16), (40, 24, 17), (128, 64, 128)])
    @pytest.mark.parametrize("T,pos0", [(1, 0), (3, 0), (1, 37), (3, 5)])
    def test_mla_attention(self, kb: KernelBackend, n: int, r: int, dv: int, T: int, pos0: int) -> None:
        rng = _rng("mla", n, r, dv, T, pos0)
        H, cap = 3, pos0 + T + 2  # the cache holds rows past the last position: ignored
        q = activations(rng, (T, H, n + r), mild=True)
        k_nope = activations(rng, (cap, H, n), mild=True)
        k_rope = activations(rng, (cap, r), mild=True)
        v = activations(rng, (cap, H, dv))
        scale = 1.0 / float(np.sqrt(n + r))
        compare(kb, "mla_attention", q, k_nope[: pos0 + T], k_rope[: pos0 + T], v[: pos0 + T], pos0, scale)
        compare(kb, "mla_attention", q, k_nope, k_rope, v, pos0, scale, what="mla, longer cache")
        hot = q * np.float32(100.0)  # scores that underflow exp_d after max subtraction
        compare(kb, "mla_attention", hot, k_nope, k_rope, v, pos0, scale, what="mla, peaked")

    @pytest.mark.parametrize("n,r,dv,C", [(24, 8, 16, 32), (40, 24, 17, 33), (1, 0, 1, 1),
                                          (33, 5, 3, 65), (128, 64, 128, 512)])
    @pytest.mark.parametrize("T,pos0", [(1, 0), (3, 0), (1, 37), (3, 5)])
    @pytest.mark.parametrize("wkind", ["bf16", "f32"])
    def test_mla_latent_attention(
        self, kb: KernelBackend, n: int, r: int, dv: int, C: int, T: int, pos0: int, wkind: str
    ) -> None:
        """Absorbed MLA over the latent cache: awkward and real widths, a cache holding rows
        past the last position (ignored), peaked scores, bf16 and float32 ``kv_b``."""
        rng = _rng("mla-latent", n, r, dv, C, T, pos0, wkind)
        H, cap = 3 if C < 512 else 2, pos0 + T + 2
        q = activations(rng, (T, H, n + r), mild=True)
        cache = activations(rng, (cap, C + r), mild=True)
        if wkind == "bf16":
            w: np.ndarray = bf16_bits(rng, (H * (n + dv), C), finite=True)
            w = np.where(((w >> 7) & 0xFF) > 0x85, w & 0x807F | 0x3F00, w).astype(np.uint16)
        else:
            w = activations(rng, (H * (n + dv), C), scale=0.2, mild=True)
        scale = 1.0 / float(np.sqrt(n + r))
        op = "mla_latent_attention"
        compare(kb, op, q, cache[: pos0 + T], w, pos0, scale)
        compare(kb, op, q, cache, w, pos0, scale, what="mla latent, longer cache")
        hot = q * np.float32(100.0)  # scores that underflow exp_d after max subtraction
        compare(kb, op, hot, cache, w, pos0, scale, what="mla latent, peaked")

    @pytest.mark.parametrize("where", ["q_nope", "q_rope", "latent", "k_rope", "weight"])
    @pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
    def test_mla_latent_attention_nonfinite(self, kb: KernelBackend, where: str, value: float) -> None:
        """One NaN or inf in a query, a cache row or ``kv_b`` propagates as IEEE says."""
        rng = _rng("mla-latent-nan", where, value)
        T, H, n, r, dv, C, pos0 = 3, 2, 9, 4, 5, 11, 2
        q = activations(rng, (T, H, n + r), mild=True)
        cache = activations(rng, (pos0 + T, C + r), mild=True)
        w = activations(rng, (H * (n + dv), C), scale=0.3, mild=True)
        target = {"q_nope": (q, (1, 0, 2)), "q_rope": (q, (0, 1, n + 1)),
                  "latent": (cache, (3, 4)), "k_rope": (cache, (1, C + 2)),
                  "weight": (w, (n + dv + 1, 3))}[where]
        target[0][target[1]] = value
        compare(kb, "mla_latent_attention", q, cache, w, pos0, 0.3, what=f"mla latent {where}={value}")

    @pytest.mark.parametrize("H,threads", [(12, 2), (7, 3), (5, 1), (16, 1)])
    def test_mla_latent_attention_long_cache(self, backend: KernelBackend, H: int,
                                             threads: int) -> None:
        """A decode step over a thousand positions at the medium model's widths (two
        column blocks of the latent, every lane of the position sums used many times), its
        heads in groups of a thread's share (sixteen on one thread: more than a backend may
        keep in registers at once) and one by one (forced)."""
        rng = _rng("mla-latent-long", H, threads)
        T, n, r, dv, C, pos0 = 1, 128, 64, 128, 203, 1100
        q = activations(rng, (T, H, n + r), mild=True)
        cache = activations(rng, (pos0 + T, C + r), mild=True)
        w = activations(rng, (H * (n + dv), C), scale=0.2, mild=True)
        backend.set_threads(threads)
        try:
            for forced in (False, True):
                backend.set_force_parallel(forced)
                compare(backend, "mla_latent_attention", q, cache, w, pos0, 0.07,
                        what=f"mla latent long, {H} heads, {threads} threads, forced {forced}")
        finally:
            backend.set_force_parallel(False)
            backend.set_threads(1)

    def test_mla_latent_attention_parallel_forced(self, backend: KernelBackend) -> None:
        """The fused op with every parallel path taken, at 1, 2 and 3 threads."""
        rng = _rng("mla-latent-forced")
        T, H, n, r, dv, C, pos0 = 3, 5, 40, 24, 17, 33, 6
        q = activations(rng, (T, H, n + r), mild=True)
        cache = activations(rng, (pos0 + T + 1, C + r), mild=True)
        w = bf16_bits(rng, (H * (n + dv), C), finite=True)
        w = np.where(((w >> 7) & 0xFF) > 0x85, w & 0x807F | 0x3F00, w).astype(np.uint16)
        backend.set_force_parallel(True)
        try:
            for threads in (1, 2, 3):
                backend.set_threads(threads)
                compare(backend, "mla_latent_attention", q, cache, w, pos0, 0.125,
                        what=f"mla latent forced, {threads} threads")
        finally:
            backend.set_force_parallel(False)
            backend.set_threads(1)

    @pytest.mark.parametrize("S", [1, 2, 9, 33])
    @pytest.mark.parametrize("T", [1, 3])
    @pytest.mark.parametrize("E", [1, 33, 4097])
    def test_attn_res(self, kb: KernelBackend, S: int, T: int, E: int) -> None:
        rng = _rng("ares", S, T, E)
        src = activations(rng, (S, T, E), scale=2.0)
        fold = activations(rng, (E,))
        compare(kb, "attn_res", src, fold, 1e-5)
        src[0] = 0.0
        compare(kb, "attn_res", src, fold, 1e-6, what="attn_res with a zero source")

    @pytest.mark.parametrize("N,k", [(3, 1), (8, 2), (64, 8), (257, 8), (5, 5)])
    @pytest.mark.parametrize("renorm", [True, False])
    def test_router(self, kb: KernelBackend, N: int, k: int, renorm: bool) -> None:
        rng = _rng("router", N, k, renorm)
        T = 3
        logits = activations(rng, (T, N))
        bias = (rng.standard_normal(N) * 0.1).astype(np.float32)
        compare(kb, "router", logits, bias, k, renorm, 2.5)
        compare(kb, "router", logits, bias, k, renorm, 1.0, what="router scale 1")

    def test_router_ties_pick_lowest_index(self, kb: KernelBackend) -> None:
        logits = np.zeros((3, 10), dtype=np.float32)
        logits[1, [2, 5, 7]] = 1.0  # three equal winners
        logits[2] = [0.0, -0.0, 0.0, -0.0, 5.0, 5.0, np.nan, -np.inf, np.inf, np.inf]
        bias = np.zeros(10, dtype=np.float32)
        idx, w = compare(kb, "router", logits, bias, 4, True, 1.0)
        for row, pick in enumerate(([0, 1, 2, 3], [2, 5, 7, 0], [8, 9, 4, 5])):
            assert idx[row].tolist() == pick, (
                f"router ties, row {row}: picked {idx[row].tolist()}, the contract {pick} (ties "
                "to the lowest index, NaN last)")
        biased = np.linspace(0.0, 1e-3, 10).astype(np.float32)[::-1].copy()  # ties broken by bias
        compare(kb, "router", logits, biased, 3, False, 1.0, what="router with bias")
        compare(kb, "router", logits, bias, 10, True, 1.0, what="router k = N (NaN last)")

    # --- adversarial inputs ----------------------------------------------------------------
    @pytest.mark.parametrize("op", adversarial.OPS)
    def test_adversarial(self, kb: KernelBackend, op: str) -> None:
        """Inputs where another summation order or a library exp gives other float32 bits:
        cancelling terms for signed reductions, float32 rounding boundaries found with the
        reference for sums of positive terms and for exp (``k3core.testing.adversarial``)."""
        for label, args in adversarial.cases(op):
            name = adversarial.op_of(label)
            compare(kb, name, *args, inplace=(5,) if name == "kda_recurrent" else (), what=label)

    # --- whole models ---------------------------------------------------------------------------
    @pytest.mark.parametrize("model", ["float32", "released"])
    @pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
    def test_model_logits(self, kb: KernelBackend, model: str, incremental: bool) -> None:
        """Two 13-layer models generated in memory (``k3core.testing.synthetic_model``):
        float32 weights, and the released layout (bf16 trunk, MXFP4 experts): the logits of
        every decoding step, byte for byte."""
        want = _reference_logits(model, incremental)
        net, prompt = _build_model(model, kb)
        got = _decode_logits(net, prompt, incremental)
        mode = "incremental" if incremental else "full recompute"
        assert len(got) == len(want), f"{model} ({mode}): {len(got)} steps of logits, the reference {len(want)}"
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bits(g, w, f"{model} logits ({mode}) step {step}")

    @pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
    @pytest.mark.parametrize("model", ["float32", "released"])
    @pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
    def test_model_logits_parallel_forced(
        self, backend: KernelBackend, threads: int, model: str, incremental: bool
    ) -> None:
        """The whole models again with every parallel path taken (``set_force_parallel``):
        the small test models stay below every work threshold, so without it the
        multi-threaded code would never run here. Same bytes at 1, 2 and 3 threads."""
        want = _reference_logits(model, incremental)
        with self._forced(backend, threads):
            net, prompt = _build_model(model, backend)
            got = _decode_logits(net, prompt, incremental)
        mode = "incremental" if incremental else "full recompute"
        assert len(got) == len(want), f"{model} ({mode}): {len(got)} steps of logits, the reference {len(want)}"
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bits(g, w, f"{model} logits ({mode}, {threads} threads forced) step {step}")


    @pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
    @pytest.mark.parametrize("chunk,incremental", [(1, True), (3, True), (2, False)],
                             ids=["incremental-1", "incremental-3", "full-2"])
    def test_model_chunked_prefill(
        self, backend: KernelBackend, threads: int, chunk: int, incremental: bool
    ) -> None:
        """The released-layout model with its prompt fed in chunks of ``chunk`` ids
        (``Model.prefill_chunk``), every parallel path forced: the logits of every step are
        the unchunked reference's bytes, and every position's logits too."""
        want = _reference_logits("released", incremental)
        with self._forced(backend, threads):
            net, prompt = _build_model("released", backend)
            net.prefill_chunk = chunk
            got = _decode_logits(net, prompt, incremental)
            assert net.chunks_last >= 1, f"prefill_chunk={chunk}: the prompt was fed in no chunks"
            every = _all_logits(net, prompt)
            assert net.chunks_last == -(-len(prompt) // chunk), (
                f"prefill_chunk={chunk}: {len(prompt)} ids fed in {net.chunks_last} chunks")
        mode = "incremental" if incremental else "full recompute"
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bits(g, w, f"logits ({mode}, chunks of {chunk}, {threads} threads) step {step}")
        assert_same_bits(every, _reference_all_logits(), f"every position's logits, chunks of {chunk}")


# ---------------------------------------------------------------------------------------
# whole-model helpers

_DECODE_STEPS = 3


def _build_model(which: str, kernels: KernelBackend) -> tuple[Any, list[int]]:
    from k3core.api.experts import InMemoryExperts
    from k3core.model.forward import Model
    from k3core.model.sources import ModelTables, ResidentTrunk, expert_from_reader

    cfg, reader, ref = _model_data(which)
    model = Model(
        cfg,
        kernels,
        ResidentTrunk(cfg, reader, cfg.n_layers),
        ModelTables(cfg, reader),
        InMemoryExperts(lambda L, e: expert_from_reader(cfg, reader, L, e)),
    )
    return model, list(ref["prompt_ids"])


def _model_data(which: str) -> tuple[Any, Any, dict[str, Any]]:
    from k3core.testing.synthetic_model import synthetic_model

    return synthetic_model(which)


def _decode_logits(model: Any, prompt: list[int], incremental: bool) -> list[np.ndarray]:
    from k3core.run.generate import generate

    run = generate(model, prompt, _DECODE_STEPS, incremental=incremental, keep_logits=True)
    return run.step_logits


@functools.lru_cache(maxsize=4)
def _reference_logits(which: str, incremental: bool) -> tuple[np.ndarray, ...]:
    model, prompt = _build_model(which, reference())
    return tuple(_decode_logits(model, prompt, incremental))


def _all_logits(model: Any, prompt: list[int]) -> np.ndarray:
    from k3core.model.state import SequenceState

    return model.forward(np.array(prompt), SequenceState(model.cfg, len(prompt)), all_logits=True)


@functools.lru_cache(maxsize=1)
def _reference_all_logits() -> np.ndarray:
    model, prompt = _build_model("released", reference())
    return _all_logits(model, prompt)
