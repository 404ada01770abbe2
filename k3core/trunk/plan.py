"""How a trunk budget is split between pinned units and a ring of streaming slots.

A *unit* is what one ring slot holds: a sub-layer part (a layer's attention or MLP/MoE
part, :mod:`k3core.trunk.parts`) when the engine streams, or a whole layer. Every token
walks the units in the same order, a cyclic scan on which an LRU of fewer slots than units
hits exactly 0 %. So k3 pins a fixed set of units (a deterministic hit rate of
pinned/units) and streams the rest through a ring of equal slots, each as large as the
largest unpinned unit (below, "run" and "layer" read "unit"). The split is a fixed point (docs/engine-behaviours.md §4, the newer,
largest-first revision):

1. the floor is one slot of the largest run; a budget below it is refused (``UsageError``,
   exit 2) naming the minimum;
2. a budget that holds every run pins everything (no ring);
3. otherwise the ring starts at the requested count (default 2, at most 8) and drops, down
   to 1, while ``ring x slot`` exceeds the budget: a second slot is taken only if it fits;
4. layers are pinned largest first (ties by index), continuing to smaller ones, while
   ``pinned + ring x slot`` fits; the slot shrinks to the largest still-unpinned run and the
   pinning repeats with the room that frees, until nothing changes (at most 8 passes);
5. the ring never has more slots than there are unpinned layers.

Sizes are the packed runs (multiples of 4096). The small vectors widened to float32 at bind
time live outside the slots and are not counted here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from k3core.api.errors import UsageError
from k3core.api.units import human

DEFAULT_RING = 2
MAX_RING = 8
MAX_PASSES = 8


@dataclass(frozen=True)
class TrunkPlan:
    budget_bytes: int
    sizes: tuple[int, ...]  # run bytes per walked layer
    pinned: tuple[int, ...]  # sorted layer indices
    ring: int  # streaming slots (0 when everything is pinned)
    slot_bytes: int
    requested_ring: int
    #: a second, smaller slot (0: every slot is ``slot_bytes``); see :func:`plan_trunk`
    small_slot_bytes: int = 0

    @property
    def slot_sizes(self) -> tuple[int, ...]:
        """Every ring slot's size, largest first."""
        if self.small_slot_bytes:
            return (self.slot_bytes, self.small_slot_bytes)
        return (self.slot_bytes,) * self.ring

    @property
    def pinned_bytes(self) -> int:
        return sum(self.sizes[i] for i in self.pinned)

    @property
    def planned_bytes(self) -> int:
        """What the trunk holds: pinned layers plus the ring."""
        return self.pinned_bytes + sum(self.slot_sizes)

    @property
    def floor_bytes(self) -> int:
        return max(self.sizes)

    @property
    def streamed(self) -> tuple[int, ...]:
        pinned = set(self.pinned)
        return tuple(i for i in range(len(self.sizes)) if i not in pinned)

    @property
    def hit_rate(self) -> float:
        return len(self.pinned) / len(self.sizes)

    @property
    def ring_held_short(self) -> bool:
        """The ring has fewer slots than asked although more layers stream than it holds."""
        return self.ring < min(self.requested_ring, len(self.streamed))

    @property
    def bytes_for_requested_ring(self) -> int:
        """Budget that would give the requested ring at today's slot size and pinning."""
        return self.pinned_bytes + self.requested_ring * self.slot_bytes


def gb_ceil(nbytes: int) -> str:
    """``nbytes`` as decimal GB rounded up to the MB (a budget that surely suffices)."""
    return f"{math.ceil(nbytes / 1e6) / 1e3:g}"


def trunk_floor(unit_sizes: Sequence[int]) -> int:
    """The smallest trunk budget that can stream: one ring slot of the largest streaming
    unit (``unit_sizes``: :func:`k3core.trunk.parts.stream_unit_sizes` of a packed trunk,
    or :func:`k3core.trunk.parts.shape_part_sizes` of a shape). Every floor k3 checks or
    prints is this one (``k3 run``'s refusal, ``k3 pack-trunk``, ``k3 budget``, the ladder)."""
    return max(int(s) for s in unit_sizes)


def floor_flag(floor_bytes: int) -> str:
    """The floor as the flag that asks for it: ``--trunk-gb 0.008``."""
    return f"--trunk-gb {gb_ceil(floor_bytes)}"


def plan_trunk(sizes: Sequence[int], budget_bytes: int, ring: int = DEFAULT_RING,
               small_slot: bool = False) -> TrunkPlan:
    """Split ``budget_bytes`` over runs of ``sizes`` (see the module docstring).

    With ``small_slot`` (the sub-layer engine), a plan left with one slot although two or
    more were asked tries a ring of two *unequal* slots instead: one of the largest unit and
    one of the largest smaller unit that still fits beside it, pinning largest first in what
    is left. Units
    alternate in size (a layer's attention part, then its MLP part), so the reader fills
    the small slot while a large unit computes and the large one while a small unit does:
    reads overlap compute at budgets where two equal slots do not fit. It is taken only
    when it fits and more than one unit streams.
    """
    plan = _plan_equal(sizes, budget_bytes, ring)
    if not small_slot or plan.ring != 1 or ring < 2 or len(plan.streamed) < 2:
        return plan
    big = max(plan.sizes)
    smaller = [n for n in plan.sizes if n < big and big + n <= budget_bytes]
    if not smaller:
        return plan
    small = max(smaller)
    order = sorted(range(len(plan.sizes)), key=lambda i: (-plan.sizes[i], i))
    pinned = _greedy(order, plan.sizes, budget_bytes - big - small)
    if len(plan.sizes) - len(pinned) < 2:
        return plan
    return TrunkPlan(budget_bytes, plan.sizes, pinned, 2, big, ring, small_slot_bytes=small)


def _plan_equal(sizes: Sequence[int], budget_bytes: int, ring: int) -> TrunkPlan:
    if not sizes:
        raise UsageError("the trunk has no layers to stream")
    if not 1 <= ring <= MAX_RING:
        raise UsageError(f"--trunk-ring must be in 1..{MAX_RING}, got {ring}")
    sizes = tuple(int(s) for s in sizes)
    floor = trunk_floor(sizes)
    if budget_bytes < floor:
        raise UsageError(
            f"--trunk-gb {budget_bytes / 1e9:g} is below the floor: one ring slot for the "
            f"largest streaming unit needs {human(floor)} ({floor_flag(floor)})",
            hint=f"pass {floor_flag(floor)} or more",
        )
    if budget_bytes >= sum(sizes):
        return TrunkPlan(budget_bytes, sizes, tuple(range(len(sizes))), 0, 0, ring)
    slot = floor
    n_ring = ring
    while n_ring > 1 and n_ring * slot > budget_bytes:
        n_ring -= 1
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    pinned: tuple[int, ...] = ()
    for _ in range(MAX_PASSES):
        cand = _greedy(order, sizes, budget_bytes - n_ring * slot)
        unpinned = [sizes[i] for i in range(len(sizes)) if i not in set(cand)]
        new_slot = max(unpinned)
        if new_slot > slot:  # a different pick left a larger run unpinned: keep the last fit
            break
        changed = cand != pinned or new_slot != slot
        pinned, slot = cand, new_slot
        if not changed:
            break
    n_streamed = len(sizes) - len(pinned)
    return TrunkPlan(budget_bytes, sizes, pinned, min(n_ring, n_streamed), slot, ring)


def _greedy(order: list[int], sizes: tuple[int, ...], room: int) -> tuple[int, ...]:
    picked = []
    for i in order:
        if sizes[i] <= room:
            picked.append(i)
            room -= sizes[i]
    return tuple(sorted(picked))


def plan_lines(plan: TrunkPlan, total_packed: int, n_layers: int,
               labels: Sequence[str] | None = None) -> list[str]:
    """The banner lines describing a plan (docs/engine-behaviours.md §3, item 6).

    ``labels`` names the units when they are sub-layer parts (``"3.attn"``, ``"3.mlp"``,
    or ``"0"`` for a layer kept whole); without it every unit is a layer.
    """
    streamed = plan.streamed
    parted = labels is not None and len(labels) > n_layers
    if parted:
        assert labels is not None
        by_layer: dict[str, list[int]] = {}
        for i, lab in enumerate(labels):
            by_layer.setdefault(lab.split(".")[0], []).append(i)
        pinned_set = set(plan.pinned)
        whole = [int(k) for k, us in by_layer.items() if all(u in pinned_set for u in us)]
        count = (f"{len(whole)}/{n_layers} layers PINNED ({len(plan.pinned)}/{len(labels)} "
                 f"parts, {human(plan.pinned_bytes)})")
        unit = "part"
    else:
        count = f"{len(plan.pinned)}/{n_layers} layers PINNED ({human(plan.pinned_bytes)})"
        unit = "layer"
    ring_text = (f"ring 2 slots ({human(plan.slot_bytes)} + {human(plan.small_slot_bytes)})"
                 if plan.small_slot_bytes else f"ring {plan.ring} x {human(plan.slot_bytes)}")
    lines = [
        f"trunk plan    : {count}, {ring_text} "
        f"= {human(plan.planned_bytes)} of a {human(plan.budget_bytes)} budget "
        f"({human(total_packed)} packed)",
    ]
    if parted:
        assert labels is not None
        lines.append(f"stream units  : {len(labels)} parts (attention, then MLP/MoE, of each "
                     f"layer); the slot is the largest unpinned part, the reader fills the "
                     "next part while the current one computes")
    tags = list(labels or ())

    def names_of(ids: Sequence[int]) -> str:
        return ",".join(tags[i] for i in ids) if parted else _ranges(ids)

    if plan.pinned and streamed:
        lines.append(f"{'pinned ' + unit + 's':<14}: {names_of(plan.pinned)} (LARGEST FIRST); largest "
                     f"unpinned {unit} {human(plan.slot_bytes)} vs largest {unit} "
                     f"{human(plan.floor_bytes)}")
    elif not plan.pinned:
        lines.append(f"{'pinned ' + unit + 's':<14}: nothing (every {unit} streams every token)")
    else:
        lines.append(f"{'pinned ' + unit + 's':<14}: all (nothing streams)")
    if plan.ring_held_short:
        lines.append(f"WARNING: ring held at {plan.ring} of {plan.requested_ring} slots; raise "
                     f"--trunk-gb to {gb_ceil(plan.bytes_for_requested_ring)} for "
                     f"{plan.requested_ring}")
    if streamed and plan.ring < 2:
        lines.append(f"note: one ring slot, so {unit}s are read on demand (no read-ahead "
                     "over the slot in use)")
    lines.append(f"deterministic hit rate {100 * plan.hit_rate:.1f} % (pinned {unit}s; a cyclic "
                 "walk defeats LRU, so nothing else is cached)")
    return lines


def _ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    groups: list[list[int]] = []
    for i in ids:
        if groups and i == groups[-1][-1] + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return ",".join(f"{g[0]}" if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)
