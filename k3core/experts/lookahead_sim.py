"""The router lookahead, replayed offline: recall, demand reads and wasted bytes of a trace.

A trace recorded with ``--lookahead`` carries its guesses (``expert_guess.bin``,
:mod:`k3core.experts.guess_trace`). The replay is the simulator's own loop
(:func:`k3core.experts.simulator.replay` with ``guesses``): at each guess's position, the
guessed experts that are not resident are placed the way the engine's cache places them
(:mod:`k3core.experts.lookahead`): into a free slot, else a victim the policy chooses among
keys that are not protected (the visit just served, other guesses not yet requested, and
every key of the guessed layer or a later one: due this step); a guess that finds no such
slot, or would make guesses not yet requested hold more than half the slots, is skipped.
When the guessed layer's visit comes, a guessed expert it requests is *used* (served
without a read on the request's path), the others are *wasted*.

The replay has no clock: every guessed read is taken to complete in time, and none is
cancelled (the engine cancels an unwanted read that has not started), and the visit before
a guess is protected whichever mode made it: it approximates what the engine sees. *Recall* depends only
on the guesses: the share of each guessed visit's distinct experts that were guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.api.cache_policy import key_expert
from k3core.experts.sim_result import SimResult
from k3core.experts.simulator import (
    PolicyFactory,
    ReplayCounts,
    TraceView,
    guess_groups,
    policy_factories,
    policy_options,
    replay,
)


@dataclass
class LookaheadRow:
    """Every policy at one size, replayed with the guesses; ``without``: the same policy's
    demand reads replayed without them."""

    slots: int
    gb: float | None
    by_policy: dict[str, ReplayCounts] = field(default_factory=dict)
    without: dict[str, int] = field(default_factory=dict)


def recall(view: TraceView, guesses: np.ndarray) -> tuple[float | None, int]:
    """``(recall, guessed visits)``: guessed share of each guessed visit's distinct experts."""
    keys = view.keys
    real = recalled = visits = 0
    starts = [v[0] for v in view.visits]
    for at, layer, experts in guess_groups(guesses):
        i = int(np.searchsorted(starts, at))  # the first visit at or after the guess
        while i < len(view.visits) and view.visits[i][2] != layer:
            i = len(view.visits) if view.visits[i][3] else i + 1  # a new pass: never came
        if i >= len(view.visits):
            continue
        s, e = view.visits[i][0], view.visits[i][1]
        want = {key_expert(k) for k in keys[s:e]}
        visits += 1
        real += len(want)
        recalled += len(want & set(experts))
    return (recalled / real if real else None), visits


def simulate_lookahead(pairs: np.ndarray, guesses: np.ndarray, sizes: Sequence[int],
                       gbs: Sequence[float | None], factories: Mapping[str, PolicyFactory],
                       topk: int, options: Mapping[str, Any], serve: str = "requests",
                       ) -> list[LookaheadRow]:
    """Every policy at every size (sizes under ``topk + 1`` skipped), with the guesses."""
    view = TraceView.of(pairs)
    rows = []
    for slots, gb in zip(sizes, gbs, strict=True):
        if slots < topk + 1:
            continue
        row = LookaheadRow(slots, gb)
        for name, factory in factories.items():
            policy = factory(capacity=slots, **options)
            row.by_policy[name] = replay(policy, view, slots, topk, guesses, serve=serve)
        rows.append(row)
    return rows


def lookahead_json(rows: list[LookaheadRow], view: TraceView, guesses: np.ndarray,
                   expert_bytes: int) -> dict[str, Any]:
    r, visits = recall(view, guesses)
    return {
        "recall": r,
        "guessed_visits": visits,
        "guesses": int(np.asarray(guesses).reshape(-1, 3).shape[0]),
        "rows": [{"slots": row.slots, "cache_gb": row.gb, "policies": {
            name: {"requests": c.requests, "hits": c.hits, "demand_reads": c.demand_reads,
                   "demand_reads_without_lookahead": row.without.get(name),
                   "guess_reads": c.guess_reads, "used": c.used, "wasted": c.wasted,
                   "skipped": c.skipped, "wasted_bytes": c.wasted * expert_bytes}
            for name, c in row.by_policy.items()}} for row in rows],
    }


def lookahead_text(rows: list[LookaheadRow], view: TraceView, guesses: np.ndarray,
                   expert_bytes: int) -> str:
    r, visits = recall(view, guesses)
    lines = [f"router lookahead: recall {'n/a' if r is None else f'{100 * r:.1f}%'} over "
             f"{visits} guessed layer visits (every guessed read taken to complete in time)",
             f"{'slots':>7} {'policy':<10} {'demand reads':>12} {'(without)':>9} "
             f"{'guess reads':>11} {'used':>7} {'wasted':>7} {'wasted GB':>9}"]
    for row in rows:
        for name, c in row.by_policy.items():
            without = str(row.without[name]) if name in row.without else "-"
            lines.append(f"{row.slots:>7} {name:<10} {c.demand_reads:>12} {without:>9} "
                         f"{c.guess_reads:>11} "
                         f"{c.used:>7} {c.wasted:>7} {c.wasted * expert_bytes / 1e9:>9.3f}")
    return "\n".join(lines)


def lookahead_for(result: SimResult, pairs: np.ndarray, guesses: np.ndarray,
                  policies: Sequence[str] | None, topk: int) -> tuple[str, dict[str, Any]]:
    """The lookahead replay at the sizes and for the policies of ``result`` (``k3 sim-cache``):
    its text block and its JSON entry."""
    opts = policy_options(pairs, result.n_layers, result.n_experts, topk)
    rows = simulate_lookahead(pairs, guesses, [r.slots for r in result.rows],
                              [r.cache_gb for r in result.rows], policy_factories(policies),
                              topk, opts, result.serve)
    for row, base in zip(rows, [r for r in result.rows if r.slots >= topk + 1], strict=True):
        for name in row.by_policy:
            rate = base.hit_rate.get(name)
            if rate is not None:
                row.without[name] = round((1.0 - rate) * result.requests)
    view = TraceView.of(pairs)
    return (lookahead_text(rows, view, guesses, result.expert_bytes),
            lookahead_json(rows, view, guesses, result.expert_bytes))
