"""The numba backend's own machinery: probe, thread setting, and the on-disk kernel cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("numba")

from k3_backends import numba_backend
from k3_backends.numba_kernels import cache

from k3core.testing.kernel_conformance import KernelConformance


class TestEveryKernelSplitAcrossThreads(KernelConformance):
    """The conformance suite again with no minimum grain, so even the small test shapes are
    divided between two threads (by default they would run on one)."""

    @pytest.fixture
    def backend(self):
        return numba_backend.NumbaBackend(threads=2, parallel_grain=0)

    @pytest.fixture
    def kb(self, backend):  # one thread count (two) instead of the base class's 1 and 2
        backend.set_threads(2)
        return backend


def test_probe_reports_missing_numba(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    avail = numba_backend._probe()
    assert not avail.ok
    assert "numba is not importable" in avail.reason
    assert avail.hint == "pip install numba"


def test_probe_ok_here():
    assert numba_backend._probe().ok


def test_set_threads_is_clamped_and_validated():
    b = numba_backend.NumbaBackend(threads=1)
    assert b.threads == 1
    b.set_threads(10_000)
    assert 1 <= b.threads <= b._max_threads
    with pytest.raises(ValueError):
        b.set_threads(0)


def test_small_kernels_stay_on_one_thread():
    from k3_backends.numba_kernels.jit import Twins

    seen = []

    def parallel():
        seen.append(("parallel", b._k.numba.get_num_threads()))

    def serial():
        seen.append(("serial", 1))

    kernel = Twins(parallel, serial)
    b = numba_backend.NumbaBackend(threads=2)
    b._run(kernel, 0)
    b._run(kernel, 10 * numba_backend.PARALLEL_GRAIN)
    forced = numba_backend.NumbaBackend(threads=2, parallel_grain=0)
    forced._run(kernel, 0)
    one = numba_backend.NumbaBackend(threads=1, parallel_grain=0)
    one._run(kernel, 10 * numba_backend.PARALLEL_GRAIN)
    if b._max_threads >= 2:
        assert seen == [("serial", 1), ("parallel", 2), ("parallel", 2), ("serial", 1)]
    else:
        assert all(kind == "serial" for kind, _ in seen)


def test_serial_and_parallel_builds_are_distinct_in_the_cache():
    from k3_backends.numba_kernels import matmul

    par, ser = matmul.dense_t1
    assert par.py_func.__qualname__ != ser.py_func.__qualname__
    assert par.targetoptions.get("parallel") and not ser.targetoptions.get("parallel")


def test_openmp_threading_layer_on_linux_unless_chosen():
    """The layer the module docstring describes: OpenMP on Linux where it loads (``workqueue``
    where it does not), ``workqueue`` elsewhere, the environment's choice when it makes one;
    and OpenMP's spin bounded unless the environment sets it."""
    import numba

    numba_backend.NumbaBackend(threads=2, parallel_grain=0).matmul_bf16(
        np.ones((4, 8), dtype=np.uint16), np.ones((1, 8), dtype=np.float32)
    )
    if os.environ.get("NUMBA_THREADING_LAYER") or os.environ.get(
            "NUMBA_THREADING_LAYER_PRIORITY", "omp workqueue tbb") != "omp workqueue tbb":
        return
    if not sys.platform.startswith("linux"):
        assert numba.threading_layer() == "workqueue"
        return
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        assert numba.threading_layer() == "workqueue"
        return
    assert numba.threading_layer() == "omp"
    if not os.environ.get("OMP_WAIT_POLICY"):
        assert os.environ.get("GOMP_SPINCOUNT")


def test_threading_layer_left_to_the_environment(monkeypatch):
    import numba

    monkeypatch.setattr(numba.config, "THREADING_LAYER_PRIORITY", ["tbb", "omp", "workqueue"])
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for chosen in ("NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"):
        monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
        monkeypatch.delenv("NUMBA_THREADING_LAYER_PRIORITY", raising=False)
        monkeypatch.setenv(chosen, "workqueue" if chosen == "NUMBA_THREADING_LAYER"
                           else "tbb omp workqueue")
        numba_backend._choose_threading_layer(numba)
        assert numba.config.THREADING_LAYER_PRIORITY == ["tbb", "omp", "workqueue"]
        assert "GOMP_SPINCOUNT" not in os.environ


def _fake_dispatcher(path):
    return SimpleNamespace(_cache=SimpleNamespace(_cache_path=str(path)))


def test_cache_guard_drops_kernels_compiled_from_other_sources(tmp_path):
    stale = [tmp_path / "matmul.dense_t1-50.py311.nbi", tmp_path / "exact.fold-99.py311.1.nbc"]
    foreign = tmp_path / "other_module.f-1.py311.nbi"
    for f in stale + [foreign]:
        f.write_bytes(b"x")
    (tmp_path / f"{cache._STAMP_PREFIX}0000").touch()  # the stamp of older sources
    removed = cache.drop_stale([_fake_dispatcher(tmp_path)])
    assert set(stale) <= set(removed)
    assert foreign.exists()  # not ours: left alone
    stamp = tmp_path / f"{cache._STAMP_PREFIX}{cache.sources_digest()}"
    assert stamp.exists()
    keep = tmp_path / "matmul.dense_t1-50.py311.nbi"
    keep.write_bytes(b"fresh")
    assert cache.drop_stale([_fake_dispatcher(tmp_path)]) == []  # same sources: nothing dropped
    assert keep.exists()


def test_second_process_loads_compiled_kernels_from_the_cache():
    b = numba_backend.NumbaBackend(threads=1)
    w = np.ones((4, 40), dtype=np.uint16)
    b.matmul_bf16(w, np.ones((1, 40), dtype=np.float32))  # compiled (or loaded) here, cached
    code = textwrap.dedent(
        """
        import numpy as np
        from k3_backends.numba_backend import NumbaBackend
        from k3_backends.numba_kernels import matmul
        b = NumbaBackend(threads=1)
        b.matmul_bf16(np.ones((4, 40), dtype=np.uint16), np.ones((1, 40), dtype=np.float32))
        s = matmul.dense_t1.serial.stats
        print(sum(s.cache_hits.values()), sum(s.cache_misses.values()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    hits, misses = (int(v) for v in out.stdout.split()[-2:])
    assert misses == 0 and hits >= 1, f"the new process recompiled: {out.stdout}{out.stderr}"


def test_e2m1_decoders_give_every_code_of_every_byte():
    """The nibble decoders (four integer operations each) against the contract's table: all
    256 bytes, both nibbles, float32 and float64, signed zeros included."""
    from k3_backends.numba_kernels.bits import e2m1_hi_d, e2m1_hi_f, e2m1_lo_d, e2m1_lo_f
    from numba import njit

    from k3core.api.contract import E2M1

    @njit
    def decode(b):
        return e2m1_lo_f(b), e2m1_hi_f(b), e2m1_lo_d(b), e2m1_hi_d(b)

    for byte in range(256):
        lo, hi = E2M1[byte & 15] * 2.0**-126, E2M1[byte >> 4] * 2.0**-126
        for got, want in zip(decode(np.uint8(byte)), (lo, hi, lo, hi), strict=True):
            assert float(got) == want and np.signbit(got) == np.signbit(want), (byte, got, want)


def _mx(rng, rows, cols):
    from k3core.api.kernels import Mxfp4

    scales = rng.integers(100, 140, (rows, cols // 32), dtype=np.uint8)
    scales.reshape(-1)[:4] = (0, 252, 254, 255)  # the table's ends and the zero scale
    return Mxfp4(rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8), scales)


@pytest.mark.parametrize("threads,grain", [(1, numba_backend.PARALLEL_GRAIN), (2, 0), (3, 0)])
@pytest.mark.parametrize("counts", [(1, 1, 1, 1, 1), (2, 1, 7, 4, 9), (5, 5, 5, 5, 5)])
def test_grouped_experts_give_the_separate_calls_bits(threads, grain, counts):
    """A layer's routed experts (every one MXFP4 of one shape) go through one parallel region
    per stage (numba_kernels/experts.py): one token each (a decode step) by the one-token
    rows, several (a prefill chunk, a batched step; counts not a multiple of four, an odd row
    count) by the several-token pass, with the bits of one situ_mlp per expert either way;
    anything else (an expert with no rows, a bf16 expert, a lone expert) keeps the separate
    calls."""
    from k3core.testing.reference import reference

    b = numba_backend.NumbaBackend(threads=threads, parallel_grain=grain)
    rng = np.random.default_rng(7)
    # W1/W3 [64 x 96], W2 [95 x 64]: an odd row count (the last pair is one row twice)
    mlps = [(_mx(rng, 64, 96), _mx(rng, 64, 96), _mx(rng, 95, 64)) for _ in range(5)]
    xs = [(rng.standard_normal((c, 96)) * 3).astype(np.float32) for c in counts]
    xs[2][0, ::7] = (np.inf, -0.0, 3e38, 1e-45, -1e-45, 7.0, -2.5, 0.0, 1.0, -1.0, 2.0, 4.0,
                     -4.0, 0.5)
    assert numba_backend._grouped_mxfp4(mlps, xs) == (64, 96, 95)
    with np.errstate(all="ignore"):
        got = b.situ_mlp_many(mlps, xs, 4.0, 25.0)
        want = [reference().situ_mlp(w1, w3, w2, x, 4.0, 25.0)
                for (w1, w3, w2), x in zip(mlps, xs, strict=True)]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.tobytes() == w.tobytes()
    none = [*xs[:4], xs[4][:0]]
    assert numba_backend._grouped_mxfp4(mlps, none) is None
    assert numba_backend._grouped_mxfp4(mlps[:1], xs[:1]) is None
    bf16 = [(rng.integers(0, 1 << 15, (64, 96), dtype=np.uint16),) * 2
            + (rng.integers(0, 1 << 15, (96, 64), dtype=np.uint16),)] * 2
    assert numba_backend._grouped_mxfp4(bf16, xs[:2]) is None


@pytest.mark.parametrize("offset", [0, 1])
def test_one_token_bf16_pairs_on_rows_only_two_byte_aligned(offset):
    """One-token bf16 rows of whole chunks are read as uint32 pairs; a checkpoint's tensor
    may start on any even byte, so a weight only two-byte aligned gives the same bits."""
    from k3core.testing.reference import reference

    rng = np.random.default_rng(3)
    buf = np.zeros(128 * 96 + 1, dtype=np.uint16)
    w = buf[offset : offset + 128 * 96].reshape(128, 96)
    w[:] = (rng.standard_normal((128, 96)).astype(np.float32).view(np.uint32) >> 16)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    b = numba_backend.NumbaBackend(threads=2, parallel_grain=0)
    assert b.matmul_bf16(w, x).tobytes() == reference().matmul_bf16(w, x).tobytes()
