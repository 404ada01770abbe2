"""``k3 cmp-logits`` reads its dumps in chunks: memory stays small whatever their size (two
3 GB dumps used to grow the process to 24 GB), dumps of different sizes are refused from
their sizes before either is read, and every statistic has the bits the one-pass formulas
over whole arrays give."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from k3core.tools.logit_compare import compare_pair, pair_disagreements
from k3core.tools.logit_dumps import DumpPair

K3 = [sys.executable, "-m", "k3core.cli"]


def one_pass(a: np.ndarray, b: np.ndarray, k: int) -> dict:
    """The statistics as k3 computed them over whole arrays before they were streamed."""
    k = min(k, a.size)
    fa, fb = np.isfinite(a), np.isfinite(b)
    both = fa & fb
    x, y = a[both].astype(np.float64), b[both].astype(np.float64)
    diff = np.abs(x - y)
    max_b = float(np.max(np.abs(y))) if y.size else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0

    def top(v: np.ndarray) -> set[int]:
        w = np.where(np.isfinite(v), v.astype(np.float64), -np.inf)
        return {int(i) for i in np.argsort(-w, kind="stable")[:k]}

    def corr() -> float:
        if x.size < 2:
            return 1.0 if np.array_equal(x, y) else 0.0
        xc, yc = x - x.mean(), y - y.mean()
        den = float(np.sqrt((xc * xc).sum() * (yc * yc).sum()))
        if den == 0:
            return 1.0 if np.array_equal(x, y) else 0.0
        return float((xc * yc).sum() / den)

    return {"n": a.size, "max_abs_diff": max_abs,
            "max_rel_diff": max_abs / max_b if max_b > 0 else (0.0 if max_abs == 0 else math.inf),
            "mean_abs_diff": float(diff.mean()) if diff.size else 0.0,
            "argmax_a": int(np.argmax(np.where(fa, a, -np.inf))),
            "argmax_b": int(np.argmax(np.where(fb, b, -np.inf))),
            "top_k": k, "top_k_overlap": len(top(a) & top(b)), "correlation": corr(),
            "nonfinite_a": int((~fa).sum()), "nonfinite_b": int((~fb).sum()),
            "identical": a.tobytes() == b.tobytes()}


def pair_of(n: int, seed: int, nonfinite: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 3).astype(np.float32)
    b = (a + rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)).astype(np.float32)
    for arr in (a, b):
        idx = rng.integers(0, n, nonfinite)
        arr[idx] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), nonfinite)
    a[:50] = np.nan  # a whole run of non-finite values at the start
    a[n // 2 : n // 2 + 7] = 4.0  # ties for the argmax and the top-k
    b[n // 3] = np.float32(40.0)
    return a, b


@pytest.mark.parametrize("n, chunk, nonfinite", [
    (129, 128, 0), (5000, 128, 40), (40_003, 1000, 900), (40_003, 4096, 0), (300_000, 1 << 18, 5)])
def test_every_statistic_has_the_bits_of_the_one_pass_formulas(n, chunk, nonfinite):
    a, b = pair_of(n, n, nonfinite)
    for k in (1, 10, 300):
        got = compare_pair(DumpPair.of(a, b, chunk), k)
        want = one_pass(a, b, k)
        assert {f: getattr(got, f) for f in want} == want, (k, got)
        assert got.mean_abs_diff.hex() == want["mean_abs_diff"].hex()
        assert got.correlation.hex() == want["correlation"].hex()


def test_the_verdict_is_the_same_chunked():
    a, b = pair_of(20_000, 1, 30)
    whole = DumpPair.of(a, b, 20_000)
    res = compare_pair(whole, 10)
    for at, rt in ((1e-4, None), (None, 1e-3), (0.0, 0.0), (10.0, None)):
        assert pair_disagreements(DumpPair.of(a, b, 128), res, at, rt) == \
            pair_disagreements(whole, res, at, rt)


def sparse(path: Path, size: int, tail: bytes = b"") -> str:
    """A file of ``size`` bytes that is all hole but ``tail`` at its end: no data written."""
    with open(path, "wb") as f:
        f.truncate(size)
        if tail:
            f.seek(size - len(tail))
            f.write(tail)
    return str(path)


# ``k3 ARGS`` in a real process that records its own peak resident set (VmHWM: the high-water
# mark of this process's memory since it started; getrusage's figure for a child would also
# count the test process's size at the fork)
PEAK = """
import sys
out, sys.argv = sys.argv[1], ["k3", *sys.argv[2:]]
from k3core.cli.__main__ import main
try:
    main()
finally:
    with open("/proc/self/status") as f, open(out, "w") as o:
        o.write(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1])
"""


def k3_rss(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[int, str, float]:
    """Run ``k3 ARGS``: exit code, output (stdout and stderr), peak RSS in MB."""
    hwm = tmp_path / "vmhwm"
    res = subprocess.run([sys.executable, "-c", PEAK, str(hwm), *args], capture_output=True,
                         text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr, int(hwm.read_text()) / 1024


@pytest.mark.parametrize("size", [128_000_000, pytest.param(3_000_000_000, marks=pytest.mark.slow)])
def test_large_dumps_are_compared_in_constant_memory(tmp_path, size):
    tail = np.array([1.5, -2.0], "<f4").tobytes()
    a = sparse(tmp_path / "a.f32", size, tail)
    b = sparse(tmp_path / "b.f32", size, np.array([1.5, -2.5], "<f4").tobytes())
    rc, out, peak = k3_rss(tmp_path, "cmp-logits", a, b, "--atol", "1")
    assert rc == 0, out
    assert f"values         : {size // 4}" in out and "max |A-B|      : 0.5" in out, out
    assert "argmax         : A " + str(size // 4 - 2) in out, out
    assert peak < 200, f"peak RSS {peak:.0f} MB for two {size / 1e9:g} GB dumps"  # whole: > 2 GB


@pytest.mark.parametrize("sizes", [(3_000_000_000, 3_000_000_004), (3_000_000_000, 3_000_000_002),
                                   (3_000_000_001, 3_000_000_001)])
def test_bad_sizes_are_refused_before_reading(tmp_path, sizes):
    a = sparse(tmp_path / "a.f32", sizes[0])
    b = sparse(tmp_path / "b.f32", sizes[1])
    t0 = time.monotonic()
    rc, out, peak = k3_rss(tmp_path, "cmp-logits", a, b)
    assert rc == 2 and out.startswith("k3: error: ") and len(out.strip().splitlines()) == 1, out
    assert time.monotonic() - t0 < 30 and peak < 200, (peak, out)  # nothing read
