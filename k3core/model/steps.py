"""What one decode step leaves behind: its index, the token it made, its seconds.

The decode loop itself is :class:`k3core.run.session.Session` (the one there is: every run,
bench, test and server job goes through it); :func:`k3core.run.generate.generate` is its
model-level form.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Step:
    index: int
    token: int
    seconds: float


class StepTimes:
    """Timing figures of a decode over its ``steps`` and ``prefill_seconds``."""

    steps: list[Step]
    prefill_seconds: float

    @property
    def wall_seconds(self) -> float:
        return sum(s.seconds for s in self.steps) + self.prefill_seconds

    @property
    def seconds_per_token(self) -> float:
        return sum(s.seconds for s in self.steps) / len(self.steps) if self.steps else 0.0
