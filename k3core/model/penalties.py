"""OpenAI's presence and frequency penalties and logit bias, on a copy of the exact logits.

For each step, with ``c[j]`` the number of times id ``j`` was generated before it in this
generation (the prompt does not count), the logits the pick sees are::

    z[j] = logit[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty + bias[j]

(OpenAI's definition). They are computed in float64 from the float32 logits, each term in
that order, on a copy: the logits themselves (what logprobs, ``--dump-logits`` and the
cache of a session hold) are never changed, and the same logits, counts and values give the
same bits on every machine (three float64 operations per id, no library function). The
greedy pick and the seeded sampler take the float64 copy as they take float32 logits
(the sampler divides by the temperature in float64 either way). With every penalty 0 and no
bias there is no copy: the pick sees the logits themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from k3core.api.errors import UsageError

#: OpenAI's ranges
PENALTY_RANGE = (-2.0, 2.0)
BIAS_RANGE = (-100.0, 100.0)
#: the most ids one ``logit_bias`` may name
MAX_BIAS_IDS = 1024


@dataclass
class Penalties:
    """The penalties of one generation; :meth:`wrap` makes a pick that applies them."""

    presence: float = 0.0
    frequency: float = 0.0
    bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lo, hi = PENALTY_RANGE
        for name, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not lo <= v <= hi:  # NaN fails too
                raise UsageError(f"{name} must be in {lo:g}..{hi:g}, got {v}")
        if len(self.bias) > MAX_BIAS_IDS:
            raise UsageError(f"logit_bias may name at most {MAX_BIAS_IDS} ids, got {len(self.bias)}")
        lo, hi = BIAS_RANGE
        for tok, v in self.bias.items():
            if not lo <= v <= hi:
                raise UsageError(f"logit_bias for id {tok} must be in {lo:g}..{hi:g}, got {v}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or any(self.bias.values()))

    def check_vocab(self, vocab: int) -> None:
        bad = [t for t in self.bias if not 0 <= t < vocab]
        if bad:
            raise UsageError(f"logit_bias names id {bad[0]}, outside the vocabulary 0..{vocab - 1}")

    def apply(self, logits: np.ndarray, counts: Mapping[int, int]) -> np.ndarray:
        """The float64 logits the pick sees after the ids in ``counts`` (module docstring)."""
        z = np.asarray(logits, dtype=np.float32).astype(np.float64)
        if counts and (self.frequency or self.presence):
            ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
            c = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            z[ids] = z[ids] - c * self.frequency - (c > 0) * self.presence
        if self.bias:
            ids = np.fromiter(self.bias, dtype=np.int64, count=len(self.bias))
            z[ids] = z[ids] + np.fromiter(self.bias.values(), dtype=np.float64, count=len(self.bias))
        return z

    def wrap(self, pick: Callable[[np.ndarray], int]) -> Callable[[np.ndarray], int]:
        """``pick`` applied to the penalised logits; counts the ids it returns (one
        generation: a fresh wrap per generation)."""
        if not self.active:
            return pick
        counts: dict[int, int] = {}

        def penalised(logits: np.ndarray) -> int:
            tok = pick(self.apply(logits, counts))
            counts[tok] = counts.get(tok, 0) + 1
            return tok

        return penalised
