"""The lane sum is exactly the contract's definition, and the definition has teeth.

``lsum(terms)``: term ``i`` goes to lane ``i % 32``; each lane starts at +0.0 and adds its
terms in increasing ``i``; the lanes are folded in halves (lane ``j`` += lane ``j + h`` for
h = 16, 8, 4, 2, 1); the result is lane 0. Here the reference (NumPy, vectorised), an
explicit Python loop over float64 values, and the same loop with every addition done in
exact rationals and rounded once (``float(Fraction)`` rounds to nearest even) must agree to
the bit; and reordering the additions must change the bits on adversarial inputs, so an
implementation that sums in another order cannot pass by luck.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from k3_backends.exact_numpy import lsum
from k3_backends.numpy_backend import NumpyBackend

from k3core.api import contract
from k3core.plugins.registry import get_registry

LANES = contract.LANES


def loop_lsum(terms, lanes=LANES, add=lambda a, b: a + b):
    """The definition, literally: per-lane sums in index order, then the halving fold."""
    acc = [0.0] * lanes
    for i, t in enumerate(terms):
        acc[i % lanes] = add(acc[i % lanes], float(t))
    h = lanes // 2
    while h >= 1:
        for j in range(h):
            acc[j] = add(acc[j], acc[j + h])
        h //= 2
    return acc[0]


def exact_add(a: float, b: float) -> float:
    """a + b computed exactly, rounded once to float64 (independent of the FPU)."""
    if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
        return a + b
    return float(Fraction(a) + Fraction(b))


def fraction_lsum(terms):
    return loop_lsum(terms, add=exact_add)


def bits(v: float) -> int:
    return int(np.float64(v).view(np.uint64))


def products(rng: np.random.Generator, n: int) -> np.ndarray:
    """Terms like the contract's: exact float64 products of float32 values, wide range."""
    a = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)
    return a.astype(np.float64) * b.astype(np.float64)


def adversarial(rng: np.random.Generator, n: int) -> np.ndarray:
    """Terms spanning 40 decades with both signs: every summation order rounds differently."""
    return rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-20, 20, n)


@pytest.mark.parametrize("n", [0, 1, 2, 31, 32, 33, 63, 64, 65, 100, 1000, 4097])
def test_reference_lsum_is_the_definition(n):
    rng = np.random.default_rng(n)
    for terms in (products(rng, n), adversarial(rng, n)):
        want = loop_lsum(terms)
        assert bits(lsum(terms)) == bits(want)
        assert bits(fraction_lsum(terms)) == bits(want)


def test_lsum_along_an_inner_axis_is_per_slice():
    rng = np.random.default_rng(7)
    t = adversarial(rng, 5 * 70 * 3).reshape(5, 70, 3)
    got = lsum(t, axis=1)
    for i in range(5):
        for k in range(3):
            assert bits(got[i, k]) == bits(loop_lsum(t[i, :, k]))


def test_lanes_start_at_plus_zero():
    assert bits(lsum(np.array([-0.0]))) == bits(0.0)
    assert bits(loop_lsum([-0.0, -0.0])) == bits(0.0)


def _alternatives():
    """Sums in other orders: each must differ from the lane sum on some adversarial input."""
    return {
        "sequential": sum_sequential,
        "exactly rounded (fsum)": lambda t: math.fsum(t),
        "np.sum (pairwise)": lambda t: float(np.sum(t)),
        "16 lanes": lambda t: loop_lsum(t, lanes=16),
        "64 lanes": lambda t: loop_lsum(t, lanes=64),
        "lanes summed in order": lambda t: sum_sequential(lane_totals(t)),
        "lanes folded pairwise-adjacent": lambda t: fold_adjacent(lane_totals(t)),
        "terms in reverse": lambda t: loop_lsum(t[::-1]),
    }


def sum_sequential(values):
    acc = 0.0
    for v in values:
        acc += float(v)
    return acc


def lane_totals(terms):
    acc = [0.0] * LANES
    for i, t in enumerate(terms):
        acc[i % LANES] += float(t)
    return acc


def fold_adjacent(lanes):
    vals = list(lanes)
    while len(vals) > 1:
        vals = [vals[2 * i] + vals[2 * i + 1] for i in range(len(vals) // 2)]
    return vals[0]


@pytest.mark.parametrize("name", list(_alternatives()))
def test_other_orders_change_the_bits(name):
    other = _alternatives()[name]
    rng = np.random.default_rng(2024)
    inputs = [adversarial(rng, n) for n in (65, 200, 1000, 4097)]
    assert any(bits(other(t)) != bits(lsum(t)) for t in inputs), (
        f"{name} agreed with the lane sum on every adversarial input: the test has no teeth"
    )


def test_reference_matmul_rows_are_lane_sums():
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((4, 101)) * 10.0 ** rng.uniform(-8, 8, (4, 101))).astype(np.float32)
    x = (rng.standard_normal((2, 101)) * 10.0 ** rng.uniform(-8, 8, (2, 101))).astype(np.float32)
    y = NumpyBackend().matmul_f32(w, x)
    for t in range(2):
        for o in range(4):
            terms = w[o].astype(np.float64) * x[t].astype(np.float64)
            assert y[t, o] == np.float32(loop_lsum(terms))


def _available_backends():
    reg = get_registry()
    return [n for n in reg.names("kernel") if reg.probe("kernel", n).ok]


@pytest.mark.parametrize("name", _available_backends())
def test_every_available_backend_sums_in_lane_order(name):
    """Cancelling giants in lanes 0 and 1 swallow the small terms of their own lanes: the lane
    sum and a sequential sum differ even after rounding to float32."""
    backend, _, _ = get_registry().create("kernel", name)
    rng = np.random.default_rng(5)
    cols = 4097
    w = rng.uniform(0.5, 2.0, (3, cols)).astype(np.float32)
    w[:, 0], w[:, 1] = 2.0**60, -(2.0**60)
    w[1] *= (10.0 ** rng.uniform(-15, 15, cols)).astype(np.float32)
    x = np.ones((1, cols), dtype=np.float32)
    y = backend.matmul_f32(w, x)
    for o in range(3):
        terms = w[o].astype(np.float64) * x[0].astype(np.float64)
        want = np.float32(loop_lsum(terms))
        assert y[0, o].view(np.uint32) == want.view(np.uint32), f"{name}: row {o}"
    terms = w[0].astype(np.float64)
    assert np.float32(loop_lsum(terms)) != np.float32(sum_sequential(terms))
