"""The kernel benchmark runs every backend on the same inputs, reports bandwidth ratios and
flags outputs that differ between backends (small cases here; real widths in the CLI)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3core.api.errors import PluginError, UsageError
from k3core.tools.bench.kernels import (
    COLUMNS,
    Case,
    _matvec_bf16,
    _matvec_mxfp4,
    default_cases,
    format_table,
    run_kernel_bench,
)


def small_cases() -> list[Case]:
    return [_matvec_bf16(64, 320, "small"), _matvec_mxfp4(48, 256, "small")]


def test_bench_two_backends_agree():
    result = run_kernel_bench(["numpy", "avx2"], threads=1, repeat=2, cases=small_cases(),
                              memory_bytes=64 << 20)
    assert result.memory_read_gbps > 0
    ran = {t.backend for t in result.timings} | set(result.skipped)
    assert ran == {"numpy", "avx2"}
    assert all(t.matches for t in result.timings), result.rows()
    for row in result.rows():
        assert len(row) == len(COLUMNS)
    doc = json.loads(result.to_json())
    assert doc["threads"] == 1 and doc["repeat"] == 2 and len(doc["timings"]) == len(result.timings)
    assert "memory read bandwidth" in format_table(result)


def test_bench_reports_unavailable_backend(monkeypatch):
    monkeypatch.setenv("K3_DISABLE_BACKENDS", "avx2")
    from k3core.plugins import registry

    monkeypatch.setattr(registry, "_CACHED", None)
    result = run_kernel_bench(["avx2"], threads=1, repeat=1, cases=small_cases(),
                              memory_bytes=16 << 20)
    assert "disabled by K3_DISABLE_BACKENDS" in result.skipped["avx2"]
    assert result.timings == []
    monkeypatch.setattr(registry, "_CACHED", None)


def test_bench_refuses_bad_counts():
    with pytest.raises(UsageError):
        run_kernel_bench(["numpy"], threads=0, repeat=1)


def test_bench_refuses_an_unknown_backend_name():
    with pytest.raises(PluginError, match="unknown kernel backend 'nosuch'; registered: .*numpy"):
        run_kernel_bench(["numpy", "nosuch"], threads=1, repeat=1, cases=small_cases(),
                         memory_bytes=16 << 20)


def test_cli_bench_kernels_unknown_backend_is_one_line_exit_2():
    from typer.testing import CliRunner

    from k3core.cli.app import app

    res = CliRunner().invoke(app, ["bench", "kernels", "--backends", "nosuch"])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3: error: unknown kernel backend"), lines


def test_default_cases_are_the_real_widths():
    cases = {c.op: c for c in default_cases()}
    assert cases["matmul_bf16 (KDA q/k/v/g proj)"].nbytes == 12288 * 7168 * 2
    assert cases["matmul_mxfp4 (expert w1/w3)"].nbytes == 3072 * 3584 // 2 + 3072 * 3584 // 32
    rng = np.random.default_rng(0)
    w, x = cases["matmul_mxfp4 (expert w2)"].make(rng)
    assert w.shape == (3584, 3072) and x.shape == (1, 3072)


def test_in_place_state_does_not_break_the_digest_comparison():
    kda = next(c for c in default_cases() if c.op == "kda_recurrent")
    small = Case(
        kda.op,
        "4 x 16 x 16",
        lambda rng: (
            *(rng.standard_normal((1, 4, 16), dtype=np.float32) for _ in range(3)),
            rng.uniform(0.9, 1.0, (1, 4, 16)).astype(np.float32),
            rng.uniform(0.0, 1.0, (1, 4)).astype(np.float32),
            rng.standard_normal((4, 16, 16), dtype=np.float32),
        ),
        kda.call,
        4 * 16 * 16 * 4,
    )
    result = run_kernel_bench(["avx2", "numpy"], threads=1, repeat=3, cases=[small],
                              memory_bytes=16 << 20)
    assert [t.matches for t in result.timings] == [True, True]


def test_a_multi_token_product_is_set_against_the_fma_peak():
    """A prefill case counts its multiply-adds; the run then measures the float64 FMA peak
    (the products' compute ceiling) and states each such product's share of it."""
    from k3core.tools.bench.kernels import _prefill_bf16, measure_fma_peak

    case = _prefill_bf16(32, 320, 6)
    assert case.macs == 32 * 320 * 6
    result = run_kernel_bench(["numpy", "avx2"], threads=1, repeat=1, cases=[case],
                              memory_bytes=16 << 20)
    assert all(t.matches and t.macs == case.macs for t in result.timings)
    assert result.fma_peak_gmacs > 0 and "FMA chains" in result.fma_method
    text = format_table(result)
    assert "float64 FMA peak" in text and "of it" in text
    assert json.loads(result.to_json())["fma_peak_gmacs"] == result.fma_peak_gmacs
    assert measure_fma_peak(1, iters=1000, passes=1)[0] > 0


def test_an_mxfp4_product_brings_the_decode_ceiling():
    """An MXFP4 case: the run measures the MXFP4 decode ceiling (weights times one token a
    second by the avx2 backend's one-token path in L1), below the FMA peak's lanes, and
    states it."""
    from k3core.tools.bench.kernels import _prefill_bf16, measure_decode_peak

    result = run_kernel_bench(["avx2"], threads=1, repeat=1,
                              cases=[_matvec_mxfp4(48, 256, "small"), _prefill_bf16(32, 320, 6)],
                              memory_bytes=16 << 20)
    if not result.timings:
        pytest.skip("the avx2 backend cannot run here")
    assert result.decode_peak_gweights > 0 and "one-token MXFP4 path" in result.decode_method
    # a decoded weight costs at least the multiply-add it feeds
    assert result.decode_peak_gweights < 1.05 * result.fma_peak_gmacs
    text = format_table(result)
    assert "MXFP4 decode ceiling" in text and "a decoded weight costs" in text
    assert json.loads(result.to_json())["decode_peak_gweights"] == result.decode_peak_gweights
    rate, how = measure_decode_peak(2, iters=200, passes=1)
    assert rate > 0 and how
