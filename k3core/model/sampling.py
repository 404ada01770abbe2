"""Choosing the next token: greedy argmax (the default) or seeded sampling.

Greedy is what makes output identical across budgets and backends: ties go to the lowest
id. Sampling (temperature, top-k, top-p) is deterministic for a given seed: one draw from
NumPy's PCG64 generator per token, computed in float64 from the float32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3core.api.errors import UsageError


def argmax(logits: np.ndarray) -> int:
    """Index of the largest logit, ties to the lowest id."""
    return int(np.argmax(logits))


@dataclass
class Sampler:
    """Seeded sampler; ``temperature`` > 0, ``top_p`` in (0, 1], ``top_k`` >= 1 or None."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not (np.isfinite(self.temperature) and self.temperature > 0):
            raise UsageError(f"--temperature must be finite and > 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"--top-k must be >= 1, got {self.top_k}")
        if self.seed < 0:
            raise UsageError(f"--seed must be a non-negative integer, got {self.seed}")
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    def __call__(self, logits: np.ndarray) -> int:
        z = logits.astype(np.float64) / self.temperature
        order = np.argsort(-z, kind="stable")
        if self.top_k is not None:
            order = order[: self.top_k]
        zs = z[order]
        p = np.exp(zs - zs[0])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            p = p[:keep] / p[:keep].sum()
            order = order[:keep]
        u = self.rng.random()
        i = int(np.searchsorted(np.cumsum(p), u, side="right"))
        return int(order[min(i, len(order) - 1)])
