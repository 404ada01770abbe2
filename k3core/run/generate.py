"""``generate(model, ids, n)``: the decode loop on a bare model, for benches and tests.

Not a second loop: it runs :class:`k3core.run.session.Session`'s, on a host that holds only
the model (no tokenizer, no end-of-sequence ids: it stops at ``stop_ids`` or after ``n_gen``
tokens). Incremental decoding (``incremental=True``) feeds the prompt once and then one
token per step; full recompute re-runs the whole prefix every step (O(T^2)); both give
bit-identical logits. ``spec`` (a :class:`~k3core.model.speculative.SpecOptions` that is on,
or a :class:`~k3core.model.speculative.Speculator`) drafts and verifies several tokens per
pass: the same ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.model.forward import Model
from k3core.model.sampling import argmax
from k3core.model.speculative import SpecOptions, SpecStats, Speculator
from k3core.model.steps import Step, StepTimes
from k3core.run.request import GenerationParams
from k3core.run.session import Session


@dataclass
class RunResult(StepTimes):
    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    first_logits: np.ndarray | None = None
    step_logits: list[np.ndarray] = field(default_factory=list)
    stopped_at: int = -1
    prefill_seconds: float = 0.0
    spec: SpecStats | None = None

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.generated_ids


@dataclass
class ModelHost:
    """What a session needs of an engine, from a bare model."""

    model: Model
    incremental: bool = True
    tokenizer: None = None
    eos_ids: set[int] = field(default_factory=set)

    @property
    def cfg(self) -> Any:
        return self.model.cfg

    @property
    def experts(self) -> Any:
        return self.model.expert_source

    @property
    def plan(self) -> Any:
        raise AttributeError("a bare model has no plan (sessions on it are not saved)")


def generate(
    model: Model,
    prompt_ids: Sequence[int],
    n_gen: int,
    *,
    incremental: bool = False,
    stop_ids: Sequence[int] = (),
    pick: Callable[[np.ndarray], int] = argmax,
    on_step: Callable[[Step], None] | None = None,
    before_step: Callable[[int], None] | None = None,
    keep_logits: bool = False,
    spec: SpecOptions | Speculator | None = None,
) -> RunResult:
    """Generate up to ``n_gen`` tokens after ``prompt_ids``; stops after emitting a stop id
    (see the module)."""
    res = RunResult([int(i) for i in prompt_ids])
    session = Session(ModelHost(model, incremental), incremental)  # type: ignore[arg-type]
    if before_step is not None:
        session.before_step = before_step  # type: ignore[method-assign,assignment]
    params = GenerationParams(max_tokens=n_gen, stop_ids=list(stop_ids), ignore_eos=True)
    speculator = spec if isinstance(spec, Speculator) else (
        Speculator(model, spec) if isinstance(spec, SpecOptions) and spec.on else None)

    def around(_inner: Callable[[np.ndarray], int]) -> Callable[[np.ndarray], int]:
        def choose(logits: np.ndarray) -> int:
            if keep_logits:
                res.step_logits.append(logits)
            return pick(logits)

        return choose

    for step, _ in session.steps(res.prompt_ids, params, around, speculator=speculator):
        if step is not None:
            res.steps.append(step)
            res.generated_ids.append(step.token)
            if on_step is not None:
                on_step(step)
    gen = session.last
    assert gen is not None
    res.first_logits = gen.first_logits
    res.prefill_seconds = gen.prefill_seconds
    res.stopped_at = gen.stopped_at
    res.spec = gen.spec
    return res
