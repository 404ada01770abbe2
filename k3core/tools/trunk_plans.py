"""The streamed-trunk plan of every preset, computed from a model's shape alone (no data).

``k3 budget`` prints it for the checkpoint it indexes, and ``k3 budget --shape real``
for a named shape (``k3core.model.shapes``), so the plan of Kimi K3 itself can be read
without its 1.5 TB: the sub-layer parts (:func:`k3core.trunk.parts.shape_part_sizes`),
the pinned parts and the ring each preset's ``trunk_gb`` gets, and whether the reader can
read ahead (two or more slots) or parts are read on demand (one slot). A budget under the
floor is reported, not raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3core.api.errors import UsageError
from k3core.api.units import human
from k3core.model.config import ModelConfig
from k3core.run.presets import Preset
from k3core.trunk.parts import shape_part_sizes
from k3core.trunk.plan import TrunkPlan, floor_flag, plan_trunk, trunk_floor


@dataclass(frozen=True)
class PresetTrunkPlan:
    preset: str
    budget_bytes: int
    plan: TrunkPlan | None  # None: below the floor
    labels: tuple[str, ...]

    @property
    def overlaps(self) -> bool:
        """The reader thread reads the next part while the current one computes."""
        return self.plan is not None and (self.plan.ring >= 2 or not self.plan.streamed)

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {"preset": self.preset, "budget_bytes": self.budget_bytes,
                "fits": p is not None, "ring": p.ring if p else 0,
                "slot_bytes": p.slot_bytes if p else 0,
                "slot_sizes": list(p.slot_sizes) if p else [],
                "pinned_parts": [self.labels[i] for i in p.pinned] if p else [],
                "pinned_bytes": p.pinned_bytes if p else 0,
                "streamed_bytes_per_token": (sum(p.sizes) - p.pinned_bytes) if p else 0,
                "read_ahead": self.overlaps}


def preset_trunk_plans(cfg: ModelConfig, presets: list[Preset]) -> list[PresetTrunkPlan]:
    units = shape_part_sizes(cfg)
    labels = tuple(lab for lab, _ in units)
    sizes = [n for _, n in units]
    out = []
    for p in presets:
        try:
            plan: TrunkPlan | None = plan_trunk(sizes, p.trunk_bytes, small_slot=True)
        except UsageError:
            plan = None
        out.append(PresetTrunkPlan(p.name, p.trunk_bytes, plan, labels))
    return out


def trunk_plan_lines(cfg: ModelConfig, plans: list[PresetTrunkPlan]) -> list[str]:
    if not plans:
        return []
    units = shape_part_sizes(cfg)
    sizes = [n for _, n in units]
    whole = shape_part_sizes(cfg, split=False)
    out = [f"streamed trunk, planned from the shape: {len(units)} parts (attention, MLP/MoE) "
           f"over {cfg.n_layers} layers, {human(sum(sizes))}; floor one slot of the largest "
           f"part {human(trunk_floor(sizes))} (a whole layer would need "
           f"{human(max(n for _, n in whole))})",
           f"  {'preset':<12}{'budget':>10}{'ring':>16}{'pinned':>18}{'streams/token':>15}  "
           "reads"]
    for tp in plans:
        p = tp.plan
        if p is None:
            out.append(f"  {tp.preset:<12}{human(tp.budget_bytes):>10}  below the floor "
                       f"({floor_flag(trunk_floor(sizes))} or more)")
            continue
        ring = (f"{human(p.slot_bytes)} + {human(p.small_slot_bytes)}" if p.small_slot_bytes
                else f"{p.ring} x {human(p.slot_bytes)}" if p.ring else "-")
        pinned = f"{len(p.pinned)} ({human(p.pinned_bytes)})"
        mode = ("nothing streams" if not p.streamed else
                "read ahead (overlap)" if p.ring >= 2 else "on demand (no overlap)")
        out.append(f"  {tp.preset:<12}{human(tp.budget_bytes):>10}{ring:>16}{pinned:>18}"
                   f"{human(sum(p.sizes) - p.pinned_bytes):>15}  {mode}")
    return out
