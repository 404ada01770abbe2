"""``k3 bench decode --context N,...``: what a decode step costs as the context grows.

A step at position N differs from one at position 10 only in latent attention: every other
op is per token (KDA's recurrent state and short-convolution history are fixed-size), and
MLA reads its latent cache up to N. Reaching 32,768 positions by prefilling them would cost
the medium model 28 T multiply-adds, minutes of a laptop-class machine, so the bench builds
the context instead: a real prefill of a short seeded prompt (at most :data:`SEED_IDS` ids),
whose latent cache rows are repeated cyclically to N - 1 rows beside the KDA state the
prompt left, and the prompt's ids repeated likewise; the N-th id is then fed and ``gen - 1``
steps decoded after it. No sequence of ids reaches that state (the rows after the seed's are
copies), but it is a state of N positions whose rows are the model's own, and the same on
every backend (the seed's prefill is bit-identical), so the ids decoded from it are checked
against ``--backend numpy`` like every other run of the bench.

Figures per N (medians of the steady steps, median of ``--repeat`` fresh engines): s/token,
the MLA layers' seconds per token (``mla_mix``, timed at the kernel interface: the latent
attention with the layers' projections, which do not grow with N) and the rest. The
attention's cost per position is the slope of those seconds per token between the smallest
and the largest N, over the positions between them; its FLOP floor is every MLA
layer's ``H x (2 C + r)`` multiply-adds a position (the score against the latent and the
rope key, the latent's weighted sum: ``mla_latent_attention`` in docs/kernel-contract.md) at
the float64 FMA peak measured in the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.api.errors import UsageError
from k3core.model.config import ModelConfig
from k3core.model.sampling import argmax
from k3core.model.state import SequenceState, StateSnapshot, snapshot
from k3core.run.engine import Engine
from k3core.run.generate import ModelHost
from k3core.run.request import GenerationParams
from k3core.run.session import Session

#: the real prefill a context is stretched from, at most this many ids
SEED_IDS = 64
#: the ops whose time grows with the context: an MLA layer in one call (``mla_mix``: its
#: latent attention and its projections, which do not grow), or its attention alone where
#: a graph calls it on its own; timed at the outermost call, so their sum is the layers'
ATTENTION_OPS = ("mla_mix", "mla_latent_attention")


def _attention_seconds(seconds: dict[str, float]) -> float:
    return sum(seconds.get(op, 0.0) for op in ATTENTION_OPS)


@dataclass
class ContextRun:
    """One decode run at a built context of ``positions`` positions."""

    positions: int
    ids: list[int]
    seconds: list[float] = field(default_factory=list)  # each steady step
    attention: list[float] = field(default_factory=list)  # its latent attention seconds


def check_contexts(contexts: list[int], cfg: ModelConfig | None = None) -> None:
    """Refuse a context list the bench cannot build (exit 2)."""
    if not contexts:
        return
    if any(n < 2 for n in contexts):
        raise UsageError(f"bench decode: every --context must be >= 2 positions, got "
                         f"{min(contexts)}")
    if len(set(contexts)) != len(contexts):
        raise UsageError("bench decode: --context names a context twice")
    if cfg is not None and cfg.n_mla == 0:
        raise UsageError("bench decode: --context needs a model with MLA layers (its cost "
                         "grows only through latent attention)")


def seed_ids(cfg: ModelConfig, seed: int, n: int) -> list[int]:
    """The seeded prompt a context is built from (``n`` ids)."""
    rng = np.random.default_rng([seed, 2])
    return [int(i) for i in rng.integers(0, cfg.vocab, n)]


def seed_state(eng: Engine, ids: list[int]) -> StateSnapshot:
    """The state after a real prefill of ``ids`` on ``eng``'s model."""
    state = SequenceState(eng.cfg, len(ids) + 1)
    eng.model.forward(np.array(ids, dtype=np.int64), state)
    return snapshot(state)


def stretched(snap: StateSnapshot, ids: list[int], positions: int
              ) -> tuple[list[int], StateSnapshot]:
    """``snap`` (reached after ``ids``) stretched to ``positions`` positions: its latent
    cache rows and its ids repeated cyclically, its KDA state as it is."""
    kv = {layer: np.resize(rows, (positions, rows.shape[1])) for layer, rows in snap.kv.items()}
    return [ids[i % len(ids)] for i in range(positions)], StateSnapshot(positions, snap.kda, kv)


def context_run(eng: Engine, snap: StateSnapshot, ids: list[int], positions: int, gen: int,
                op_seconds: Callable[[], dict[str, float]],
                on_token: Callable[[int], None] | None = None) -> ContextRun:
    """On ``eng`` (opened for ``positions + gen`` positions): the context of ``positions``
    positions built from ``snap`` (reached after ``ids``), its last id fed, ``gen`` tokens
    decoded greedily; ``op_seconds()`` reads the seconds spent in each kernel op so far."""
    all_ids, built = stretched(snap, ids, positions - 1)
    session = Session(ModelHost(eng.model, True), True)  # type: ignore[arg-type]
    session.resume(all_ids, built)
    run = ContextRun(positions, [])
    params = GenerationParams(max_tokens=gen, ignore_eos=True)
    last = _attention_seconds(op_seconds())

    def around(_inner: Callable[[np.ndarray], int]) -> Callable[[np.ndarray], int]:
        return argmax

    tail = [ids[(positions - 1) % len(ids)]]
    for step, _ in session.steps(tail, params, around):
        if step is None:
            continue
        now = _attention_seconds(op_seconds())
        if run.ids:  # the first token is the fed id's pass (the prefill's), not timed
            run.seconds.append(step.seconds)
            run.attention.append(now - last)
        last = now
        run.ids.append(step.token)
        if on_token is not None:
            on_token(len(run.ids))
    return run


def attention_floor_per_position(cfg: ModelConfig, fma_gmacs: float) -> float:
    """Seconds a position of context costs a token at least: every MLA layer's
    ``H x (2 C + r)`` multiply-adds at the float64 FMA peak (0 when unmeasured)."""
    if fma_gmacs <= 0:
        return 0.0
    macs = cfg.n_mla * cfg.n_heads * (2 * cfg.kv_lora + cfg.qk_rope)
    return macs / (fma_gmacs * 1e9)


def slope(positions: list[int], seconds: list[float]) -> float:
    """Seconds per position between the smallest and the largest context (0 with one)."""
    if len(positions) < 2:
        return 0.0
    lo, hi = positions.index(min(positions)), positions.index(max(positions))
    return (seconds[hi] - seconds[lo]) / (positions[hi] - positions[lo])


def summary(runs: dict[int, list[ContextRun]]) -> dict[str, Any]:
    """Per context (in the order given): the median over runs of each run's median steady
    s/token and attention seconds per token, and the runs' own figures."""
    def med(xs: list[float]) -> float:
        return float(np.median(xs)) if xs else 0.0

    ns = list(runs)
    per = [[med(r.seconds) for r in runs[n]] for n in ns]
    att = [[med(r.attention) for r in runs[n]] for n in ns]
    return {"context_positions": ns,
            "context_seconds_per_token": [med(x) for x in per],
            "context_seconds_per_token_runs": per,
            "context_attention_seconds_per_token": [med(x) for x in att]}
