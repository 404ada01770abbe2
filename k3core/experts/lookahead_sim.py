"""The router lookahead, replayed offline: recall, demand reads and wasted bytes of a trace.

A trace recorded with ``--lookahead`` carries its guesses (``expert_guess.bin``,
:mod:`k3core.experts.guess_trace`). :func:`replay_lookahead` replays the trace exactly as
:func:`k3core.experts.simulator.replay_policy` does and, at each guess's position, places
the guessed experts that are not resident the way the engine's cache does
(:class:`k3core.experts.cache.ExpertCache`): into a free slot, else a victim the policy
chooses among keys that are not protected (the visit just served, other guesses not yet
requested, and every key of the guessed layer or a later one: due this step); a guess that
finds no such slot, or would make guesses not yet requested hold more than half the slots,
is skipped. When the guessed layer's visit comes, a guessed expert it
requests is *used* (served without a read on the request's path), the others are *wasted*.

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

from k3core.api.cache_policy import KEY_SHIFT, CachePolicy
from k3core.api.errors import PluginError
from k3core.experts.sim_result import SimResult
from k3core.experts.simulator import PolicyFactory, TraceView, _registered_policies


@dataclass
class LookaheadCounts:
    """One policy at one size, replayed with the guesses."""

    requests: int = 0
    misses_without: int | None = None  # the same policy and size replayed without guesses
    hits: int = 0  # resident before the request (guessed or not)
    demand_reads: int = 0  # misses the request had to read itself
    guess_reads: int = 0
    used: int = 0  # guessed reads a later request of their layer's visit used
    wasted: int = 0  # guessed reads their layer's visit did not request
    skipped: int = 0  # guesses with no slot a guess may take


@dataclass
class LookaheadRow:
    slots: int
    gb: float | None
    by_policy: dict[str, LookaheadCounts] = field(default_factory=dict)


def recall(view: TraceView, guesses: np.ndarray) -> tuple[float | None, int]:
    """``(recall, guessed visits)``: guessed share of each guessed visit's distinct experts."""
    keys = view.keys
    real = recalled = visits = 0
    starts = [v[0] for v in view.visits]
    for at, layer, experts in _groups(guesses):
        i = int(np.searchsorted(starts, at))  # the first visit at or after the guess
        while i < len(view.visits) and view.visits[i][2] != layer:
            i = len(view.visits) if view.visits[i][3] else i + 1  # a new pass: never came
        if i >= len(view.visits):
            continue
        s, e = view.visits[i][0], view.visits[i][1]
        want = {k & ((1 << KEY_SHIFT) - 1) for k in keys[s:e]}
        visits += 1
        real += len(want)
        recalled += len(want & set(experts))
    return (recalled / real if real else None), visits


def _groups(guesses: np.ndarray) -> list[tuple[int, int, list[int]]]:
    out: list[tuple[int, int, list[int]]] = []
    for at, layer, e in np.asarray(guesses, dtype=np.int64).reshape(-1, 3).tolist():
        if out and out[-1][0] == at and out[-1][1] == layer:
            out[-1][2].append(e)
        else:
            out.append((at, layer, [e]))
    return out


def replay_lookahead(policy: CachePolicy, view: TraceView, capacity: int, topk: int,
                     guesses: np.ndarray) -> LookaheadCounts:
    """Drive ``policy`` through the trace with its guesses (see the module docstring)."""
    resident: set[int] = set()
    pending: dict[int, int] = {}  # guessed key -> its layer, not yet requested
    out = LookaheadCounts(requests=len(view.keys))
    keys = view.keys
    groups = _groups(guesses)
    gi = 0
    last_visit: list[int] = []

    def place(k: int, keep: set[int]) -> bool:
        if len(resident) >= capacity:
            if all(r in keep for r in resident):
                return False
            v = policy.choose_victim(keep)
            if v is None:
                return False
            if v not in resident or v in keep:
                what = "not resident" if v not in resident else "protected"
                raise PluginError(f"cache policy '{policy.name}' chose victim {v:#x}, which is {what}")
            resident.remove(v)
            pending.pop(v, None)
            policy.on_evict(v)
        resident.add(k)
        policy.on_insert(k)
        return True

    def guess(layer: int, experts: list[int]) -> None:
        keep = {r for r in resident if r >> KEY_SHIFT >= layer} | set(pending) | set(last_visit)
        for e in dict.fromkeys(experts):
            k = (layer << KEY_SHIFT) | e
            if k in resident:
                continue
            if len(pending) < capacity // 2 and place(k, keep):
                keep.add(k)
                pending[k] = layer
                out.guess_reads += 1
            else:
                out.skipped += 1

    for start, end, layer, new_pass in view.visits:
        while gi < len(groups) and groups[gi][0] <= start:
            guess(groups[gi][1], groups[gi][2])
            gi += 1
        if new_pass:
            policy.begin_token()
        policy.begin_layer(layer, keys[start:end])
        want = set(keys[start:end])
        for k, gl in list(pending.items()):
            if gl == layer and k in want:
                continue
            if gl <= layer or new_pass:
                del pending[k]
                out.wasted += 1
        protected: set[int] = set()
        for j in range(start, end):
            if (j - start) % topk == 0:
                protected = set()
            k = keys[j]
            if k in resident:
                if pending.pop(k, None) is not None:
                    out.used += 1
                else:
                    out.hits += 1
                policy.on_hit(k)
            else:
                out.demand_reads += 1
                if policy.admit(k, protected):
                    if len(resident) >= capacity:
                        keep = protected | set(pending)
                        v = policy.choose_victim(keep)
                        if v is None:
                            protected.add(k)
                            continue
                        if v not in resident or v in keep:
                            what = "not resident" if v not in resident else "protected"
                            raise PluginError(
                                f"cache policy '{policy.name}' chose victim {v:#x}, which is {what}")
                        resident.remove(v)
                        policy.on_evict(v)
                    resident.add(k)
                    policy.on_insert(k)
            protected.add(k)
        last_visit = keys[start:end]
    out.wasted += len(pending)
    return out


def simulate_lookahead(pairs: np.ndarray, guesses: np.ndarray, sizes: Sequence[int],
                       gbs: Sequence[float | None], factories: Mapping[str, PolicyFactory],
                       topk: int, options: Mapping[str, Any]) -> list[LookaheadRow]:
    """Every policy at every size (sizes under ``topk + 1`` skipped), with the guesses."""
    view = TraceView.of(pairs)
    rows = []
    for slots, gb in zip(sizes, gbs, strict=True):
        if slots < topk + 1:
            continue
        row = LookaheadRow(slots, gb)
        for name, factory in factories.items():
            policy = factory(capacity=slots, **options)
            row.by_policy[name] = replay_lookahead(policy, view, slots, topk, guesses)
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
                   "demand_reads_without_lookahead": c.misses_without,
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
            without = "-" if c.misses_without is None else str(c.misses_without)
            lines.append(f"{row.slots:>7} {name:<10} {c.demand_reads:>12} {without:>9} "
                         f"{c.guess_reads:>11} "
                         f"{c.used:>7} {c.wasted:>7} {c.wasted * expert_bytes / 1e9:>9.3f}")
    return "\n".join(lines)


def lookahead_for(result: SimResult, pairs: np.ndarray, guesses: np.ndarray,
                  policies: Sequence[str] | None, topk: int) -> tuple[str, dict[str, Any]]:
    """The lookahead replay at the sizes and for the policies of ``result`` (``k3 sim-cache``):
    its text block and its JSON entry."""
    factories = _registered_policies(policies)
    opts = {"n_layers": result.n_layers, "n_experts": result.n_experts, "topk": topk,
            "trace": pairs}
    rows = simulate_lookahead(pairs, guesses, [r.slots for r in result.rows],
                              [r.cache_gb for r in result.rows], factories, topk, opts)
    for row, base in zip(rows, [r for r in result.rows if r.slots >= topk + 1], strict=True):
        for name, c in row.by_policy.items():
            rate = base.hit_rate.get(name)
            if rate is not None:
                c.misses_without = round((1.0 - rate) * result.requests)
    view = TraceView.of(pairs)
    return (lookahead_text(rows, view, guesses, result.expert_bytes),
            lookahead_json(rows, view, guesses, result.expert_bytes))
