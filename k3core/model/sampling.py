"""Choosing the next token: greedy argmax (the default) or seeded sampling.

Greedy is what makes output identical across budgets and backends: ties go to the lowest
id. Sampling (temperature, top-k, top-p) is deterministic for a given seed, and the same
on every backend, machine and NumPy build, because nothing in it is left to a library:

* the logits are bit-identical on every backend (the kernel contract);
* ``z = d(logit) / temperature`` in float64, ordered by a stable sort (ties to the lowest
  id), truncated to the ``top_k`` largest;
* the weights are the contract's ``exp_d(z - z_max)`` (``k3core.api.contract``, the same
  polynomial every kernel backend uses; never the platform's libm ``exp``), normalised by
  the contract's 32-lane sum (:func:`lane_sum`); the cumulative sums are sequential;
* ``top_p`` keeps the smallest prefix whose mass reaches ``top_p``, then renormalises;
* one uniform draw per token: the top 53 bits of one raw 64-bit output of PCG64 seeded with
  ``seed`` (the bit generator's algorithm, not a NumPy distribution method that may change
  between releases), scaled by 2**-53; the token is the first whose cumulative mass
  exceeds it.

A temperature below :data:`MIN_TEMPERATURE` (1e-5; 0 too) is greedy: the argmax, no draw.
At 1e-5 a logit 4e-4 below the largest already has a weight under 2**-53, and a much smaller
temperature overflows float64 (``logit / 1e-310`` is infinite). Nothing is drawn from NaN
probabilities: the scaled logits, the weights and their sum must be finite and the sum > 0
(it is at least 1, the largest id's weight), or the draw is refused with a
:class:`~k3core.api.errors.K3Error` (exit 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from k3core.api.contract import EXP_COEF, EXP_HI, EXP_LO, LANES, LN2_HI, LN2_LO, LOG2E
from k3core.api.errors import K3Error, UsageError, param

#: temperatures below this (0 included) choose greedily: the documented minimum
#: (docs/cli.md, docs/server.md, docs/python-api.md)
MIN_TEMPERATURE = 1e-5


def is_greedy_temperature(temperature: float) -> bool:
    """True where ``temperature`` (finite, >= 0) means the argmax, not a draw."""
    return temperature < MIN_TEMPERATURE


def check_sampling(temperature: float | None, top_p: float | None, top_k: int | None,
                   seed: int | None) -> None:
    """Refuse, naming the parameter, a sampling value that is out of range, NaN or infinite
    (``None``: not given)."""
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise UsageError(f"{param('temperature')} must be finite and >= 0 (below "
                         f"{MIN_TEMPERATURE:g} = greedy), got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:  # NaN fails both comparisons
        raise UsageError(f"{param('top_p')} must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise UsageError(f"{param('top_k')} must be >= 1, got {top_k}")
    if seed is not None and seed < 0:
        raise UsageError(f"{param('seed')} must be a non-negative integer, got {seed}")


def argmax(logits: np.ndarray) -> int:
    """Index of the largest logit, ties to the lowest id."""
    return int(np.argmax(logits))


def exp_d(x: np.ndarray) -> np.ndarray:
    """The kernel contract's float64 ``exp_d``, elementwise (docs/kernel-contract.md)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        n = np.floor(x * LOG2E + 0.5)
        r = (x - n * LN2_HI) - n * LN2_LO
        p = np.full_like(x, EXP_COEF[13])
        for c in reversed(EXP_COEF[:13]):
            p = p * r + c
        ok = np.isfinite(n)
        out = np.ldexp(p, np.where(ok, n, 0).astype(np.int64))
    out = np.where(x > EXP_HI, np.inf, out)
    out = np.where(x < EXP_LO, 0.0, out)
    return np.where(np.isnan(x), np.nan, out)


def lane_sum(v: np.ndarray) -> float:
    """The contract's lane sum of float64 terms: 32 lanes, each in order, folded in halves."""
    v = np.asarray(v, dtype=np.float64).reshape(-1)
    pad = (-v.size) % LANES
    rows = np.concatenate([v, np.zeros(pad)]).reshape(-1, LANES)
    lanes = np.cumsum(rows, axis=0)[-1] + 0.0  # a running sum: lane j in increasing index
    h = LANES // 2
    while h:
        lanes = lanes[:h] + lanes[h : 2 * h]
        h //= 2
    return float(lanes[0])


def _mass(w: np.ndarray) -> float:
    """The contract's sum of the weights, checked: finite, and > 0 (NaN fails both)."""
    total = lane_sum(w)
    if not (math.isfinite(total) and total > 0) or not np.isfinite(w).all():
        raise K3Error(f"sampling: the weights sum to {total}; refusing to draw from NaN or "
                      "infinite probabilities")
    return total


@dataclass
class Sampler:
    """Seeded sampler; ``temperature`` >= 0 (below :data:`MIN_TEMPERATURE` is greedy),
    ``top_p`` in (0, 1], ``top_k`` >= 1 or None."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k, self.seed)
        self.bits = np.random.PCG64(self.seed)

    @property
    def greedy(self) -> bool:
        return is_greedy_temperature(self.temperature)

    def uniform(self) -> float:
        """One draw in [0, 1) from the raw PCG64 stream (53 bits)."""
        raw = int(self.bits.random_raw())
        return (raw >> 11) * 2.0**-53

    def probabilities(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, p)``: the ids that may be drawn, most likely first, and their
        probabilities after temperature, top-k and top-p (see the module docstring)."""
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            z = np.asarray(logits).astype(np.float64) / self.temperature
        if z.size == 0 or not np.isfinite(z).all():
            raise K3Error(f"sampling: logits / temperature {self.temperature:g} are not all "
                          "finite; refusing to draw from NaN or infinite probabilities")
        order = np.argsort(-z, kind="stable")
        if self.top_k is not None:
            order = order[: self.top_k]
        zs = z[order]
        w = exp_d(zs - zs[0])  # every exponent <= 0: weights in [0, 1], the first exactly 1
        p = w / _mass(w)
        if self.top_p < 1.0:
            keep = min(len(p), int(np.searchsorted(np.cumsum(p), self.top_p) + 1))
            order, w = order[:keep], w[:keep]
            p = w / _mass(w)
        return order, p

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return argmax(logits)
        order, p = self.probabilities(logits)
        u = self.uniform()
        i = int(np.searchsorted(np.cumsum(p), u, side="right"))
        return int(order[min(i, len(order) - 1)])
