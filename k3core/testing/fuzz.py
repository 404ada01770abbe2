"""Helpers for the hostile-input fuzz tests: one generator, two sources of choices.

A fuzz generator is written once against :class:`Draw` (``choice``, ``randint``,
``chance``, ``blob``). :class:`HypothesisDraw` feeds it from Hypothesis (so failures shrink
to a small case); :class:`SeededDraw` feeds it from a seeded ``random.Random`` so a batch of
cases costs one Hypothesis example (Hypothesis itself costs ~0.6 ms per example, which
would dominate a 10,000-case run). Both are deterministic under :func:`fuzz_settings`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

T = TypeVar("T")


class Draw(Protocol):
    def choice(self, seq: Sequence[T]) -> T: ...

    def randint(self, low: int, high: int) -> int: ...

    def chance(self, p: float) -> bool: ...

    def blob(self, max_size: int) -> bytes: ...


class SeededDraw:
    """Choices from ``random.Random(seed)``."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.rng.randrange(len(seq))]

    def randint(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def blob(self, max_size: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, max_size))


class HypothesisDraw:
    """Choices drawn inside a Hypothesis strategy (shrinkable); see :func:`cases`."""

    def __init__(self, draw: Callable[[Any], Any]):
        self.draw = draw

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.draw(st.integers(0, len(seq) - 1))]

    def randint(self, low: int, high: int) -> int:
        return int(self.draw(st.integers(low, high)))

    def chance(self, p: float) -> bool:
        return bool(self.draw(st.integers(0, 999)) >= 1000 * (1 - p))

    def blob(self, max_size: int) -> bytes:
        return bytes(self.draw(st.binary(max_size=max_size)))


def cases(generator: Callable[[Draw], T]) -> st.SearchStrategy[T]:
    """A strategy whose examples are ``generator(HypothesisDraw(...))``.

    Drawing inside a composite strategy is several times cheaper than ``st.data()``, which
    records every draw for its failure report.
    """

    @st.composite
    def strategy(draw: Callable[[Any], Any]) -> T:
        return generator(HypothesisDraw(draw))

    return strategy()


def fuzz_settings(examples: int) -> Any:
    """Seeded, no example database, no deadline: the same cases on every run."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)
