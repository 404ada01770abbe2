"""The decode loop: incremental or full recompute, greedy or seeded sampling.

Incremental decoding (what a run does unless its request asks for full recompute,
``--full-recompute``) feeds the prompt once and then one token per step, carrying the KDA
state, the conv history and the MLA KV cache; full recompute re-runs the whole prefix from a
fresh state every step (O(T^2)). Both give bit-identical logits. :func:`generate` itself
takes the mode as ``incremental`` (False unless given: its callers pass the request's
setting).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from k3core.model.forward import Model
from k3core.model.sampling import argmax
from k3core.model.speculative import SpecOptions, SpecStats, Speculator
from k3core.model.state import SequenceState


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
    """Generate up to ``n_gen`` tokens after ``prompt_ids``; stops after emitting a stop id.
    ``spec`` (on) drafts and verifies several tokens per pass: the same ids
    (:mod:`k3core.model.speculative`)."""
    res = RunResult(list(int(i) for i in prompt_ids))
    ids = list(res.prompt_ids)
    state = SequenceState(model.cfg, len(ids) + max(n_gen, 1)) if incremental else None
    if n_gen == 0:  # prefill only (warms the state; --dump-logits still has its vector)
        t0 = time.perf_counter()
        st = state or SequenceState(model.cfg, len(ids), shared_kda_slot=model.shared_kda_slot)
        res.first_logits = model.forward(np.array(ids), st)[-1]
        res.prefill_seconds = time.perf_counter() - t0
        return res
    stops = set(stop_ids)
    if isinstance(spec, SpecOptions):
        spec = Speculator(model, spec) if spec.on else None
    if spec is not None:
        _speculate(model, res, n_gen, state, stops, pick, on_step, before_step, keep_logits,
                   spec)
        return res
    for g in range(n_gen):
        if before_step is not None:
            before_step(g)
        t0 = time.perf_counter()
        if incremental:
            assert state is not None
            feed = ids if g == 0 else ids[-1:]
            logits = model.forward(np.array(feed), state)[-1]
        else:
            fresh = SequenceState(model.cfg, len(ids), shared_kda_slot=model.shared_kda_slot)
            logits = model.forward(np.array(ids), fresh)[-1]
        if g == 0:
            res.first_logits = logits
        if keep_logits:
            res.step_logits.append(logits)
        tok = pick(logits)
        ids.append(tok)
        res.generated_ids.append(tok)
        step = Step(g, tok, time.perf_counter() - t0)
        res.steps.append(step)
        if on_step is not None:
            on_step(step)
        if tok in stops:
            res.stopped_at = tok
            break
    return res


def _speculate(model: Model, res: RunResult, n_gen: int, state: SequenceState | None,
               stops: set[int], pick: Callable[[np.ndarray], int],
               on_step: Callable[[Step], None] | None, before_step: Callable[[int], None] | None,
               keep_logits: bool, spec: Speculator) -> None:
    """The decode loop with drafts: each pass emits one token or more, as plain decoding."""
    ids = res.full_ids
    g = 0
    while g < n_gen:
        if before_step is not None:
            before_step(g)
        t0 = time.perf_counter()
        sure = len(ids) - state.pos if state is not None else len(ids)
        drafts = spec.propose(ids, n_gen - g, sure)
        rows = spec.verify(ids, state, drafts)
        toks: list[int] = []
        for i, row in enumerate(rows):
            if g == 0 and i == 0:
                res.first_logits = row
            if keep_logits:
                res.step_logits.append(row)
            tok = pick(row)
            toks.append(tok)
            if tok in stops or g + len(toks) >= n_gen or i >= len(drafts) or tok != drafts[i]:
                break
        ids.extend(toks)
        spec.settle(state, len(ids) - 1)
        seconds = time.perf_counter() - t0
        spec.record(g, drafts, toks, seconds)
        for tok in toks:
            res.generated_ids.append(tok)
            step = Step(g, tok, seconds / len(toks))
            res.steps.append(step)
            g += 1
            if on_step is not None:
                on_step(step)
        if toks[-1] in stops:
            res.stopped_at = toks[-1]
            break
    res.spec = spec.stats
