"""What one generation made: its ids and text, its timings, why it stopped.

A :class:`Generation` is the result of one call of a session (:mod:`k3core.run.session`)
and what the report (:mod:`k3core.run.report`) reads: it sits below both, so the report
never imports the session that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.model.sampling import Sampler
from k3core.model.speculative import SpecStats
from k3core.model.steps import Step, StepTimes

__all__ = ["Generation"]


@dataclass(kw_only=True)
class Generation(StepTimes):
    """What one call made: ids, text, timings, why it stopped. ``report`` is the run record."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str | None = None
    steps: list[Step] = field(default_factory=list)
    first_logits: np.ndarray | None = None
    stopped_at: int = -1
    #: why it stopped: ``length`` (max_tokens made), ``context`` (the context is full: the
    #: end of ``max_tokens`` -1, or ``context`` reached first), ``stop_id``, ``eos``, ``stop``
    #: (a stop text), ``prefill`` (max_tokens 0), ``interrupted`` (Ctrl-C; ``interrupted`` too)
    stop_reason: str = "length"
    #: the most tokens it could make: ``max_tokens``, or what the context left
    limit: int = 0
    prefill_seconds: float = 0.0
    #: the first forward pass (the prompt): ids fed, passes (chunks), routed-expert bytes read
    prefill_ids: int = 0
    prefill_chunks: int = 0
    prefill_expert_bytes: int = 0
    interrupted: bool = False
    sampler: Sampler | None = None
    report: dict[str, Any] = field(default_factory=dict)
    spec: SpecStats | None = None  # what --spec ngram|auto did

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    def mark_interrupted(self) -> None:
        """A Ctrl-C ended it: what was made is kept, and that is why it stopped."""
        self.interrupted, self.stop_reason = True, "interrupted"
