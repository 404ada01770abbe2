"""Repeated timings, and when one setting is faster than another beyond their noise.

``k3 tune`` times every candidate of a knob several times (fresh engine each run), the runs
of all candidates alternating in rotated order so that the machine's drift spreads over all
of them. A candidate's timing is the list of its runs (seconds per token, each the median
decode step of one run). The rule (:func:`beats`): a candidate beats the baseline only when
its **worst** run is faster than the baseline's **best** run, so their ranges do not
overlap; then the difference of their medians exceeds the spread of either. :func:`pick`
keeps the fastest median among the candidates that beat the baseline, and otherwise the
baseline ("no candidate won beyond noise"). A single run per side has no spread to compare
with, so :data:`MIN_RUNS` runs are required. For two equally fast options with independent
runs, R runs each separate by chance with probability 1 / C(2R, R): 5 % at R = 3, 1.4 % at
4, 0.4 % at 5.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

#: runs per candidate that give a spread to compare against
MIN_RUNS = 2
#: ``k3 tune --repeat`` default and ceiling
DEFAULT_RUNS = 3
MAX_RUNS = 20

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Timing:
    """The runs of one candidate, seconds per token, in the order they ran."""

    runs: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def best(self) -> float:
        return min(self.runs)

    @property
    def worst(self) -> float:
        return max(self.runs)

    @property
    def spread(self) -> float:
        """Worst minus best run."""
        return self.worst - self.best

    def to_json(self) -> dict[str, object]:
        return {"runs": list(self.runs), "median": self.median, "best": self.best,
                "worst": self.worst, "spread": self.spread}

    def describe(self) -> str:
        rel = self.spread / self.median if self.median > 0 else 0.0
        return (f"median {self.median:.4f} s/token, spread {self.spread:.4f} "
                f"({self.best:.4f}..{self.worst:.4f}, {rel:.0%}, {len(self.runs)} runs)")


def beats(candidate: Sequence[float], baseline: Sequence[float]) -> bool:
    """True when every run of ``candidate`` is faster than every run of ``baseline``."""
    return (len(candidate) >= MIN_RUNS and len(baseline) >= MIN_RUNS
            and max(candidate) < min(baseline))


def pick(baseline: K, timings: Mapping[K, Sequence[float]]) -> tuple[K, bool]:
    """``(kept, won)``: the fastest median among candidates that :func:`beats` the
    baseline (``won`` True), else the baseline itself (``won`` False)."""
    base = timings[baseline]
    winners = [k for k, runs in timings.items() if k != baseline and beats(runs, base)]
    if not winners:
        return baseline, False
    return min(winners, key=lambda k: statistics.median(timings[k])), True


def rotated(items: Sequence[K], round_no: int) -> list[K]:
    """``items`` rotated by ``round_no``: over rounds each runs in every position."""
    if not items:
        return []
    r = round_no % len(items)
    return [*items[r:], *items[:r]]
