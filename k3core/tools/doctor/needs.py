"""What running a model asks of the disk: room for the checkpoint and the packed trunk, and
the read bandwidth each preset's streaming needs. The honest half of ``k3 doctor``'s disk
section.

Sizes are the model's own (counted from its shards) when ``k3 doctor MODEL_DIR`` is given,
else Kimi K3's released figures planned from its config (``k3core.model.sizes``): a
108.8 GB trunk and about 1.56 TB of checkpoint.

Bytes one token reads under a preset are the trunk layers its budget does not pin (a
whole-layer plan, :func:`k3core.trunk.plan.plan_trunk`; ``k3 run`` plans sub-layer parts,
which pins a little more at the same budget, so this errs high) plus the routed experts the
cache misses, estimated as if routing were uniform (a cache holding a fraction f of all
experts hits f of the time; real routing is skewed, so real runs hit more). At the measured
bandwidth that gives a floor on seconds per token spent reading.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import ModelSizes, align_up, sizes_from_config
from k3core.run.preset import Preset
from k3core.trunk.plan import plan_trunk

#: a preset whose reads alone take longer than this per token is rated "warn"
SLOW_SECONDS_PER_TOKEN = 60.0


def released_sizes() -> ModelSizes:
    """Kimi K3's sizes, planned from its config and the released dtypes."""
    return sizes_from_config(ModelConfig.from_json_dict(size_config("real"), source="Kimi K3"))


def checkpoint_bytes(sz: ModelSizes) -> int:
    """Trunk, tables and every routed expert: what the checkpoint's shards hold."""
    return sz.trunk_bytes + sz.tables_bytes + sz.expert_bytes * sz.n_experts * sz.n_moe_layers


def packed_trunk_bytes(sz: ModelSizes) -> int:
    """``trunk.bin``: every layer's run padded to 4096."""
    return sum(align_up(b) for b in sz.layer_bytes)


@dataclass(frozen=True)
class PresetReads:
    preset: str
    trunk_bytes: int  # streamed trunk bytes per token
    expert_bytes: int  # routed-expert bytes per token (uniform-routing estimate)
    pinned_layers: int
    n_layers: int

    @property
    def total(self) -> int:
        return self.trunk_bytes + self.expert_bytes

    def seconds_at(self, mb_per_s: float) -> float:
        return self.total / (mb_per_s * 1e6) if mb_per_s > 0 else float("inf")


def preset_reads(p: Preset, sz: ModelSizes) -> PresetReads:
    """Bytes one decode step reads from disk under preset ``p``."""
    runs = [align_up(b) for b in sz.layer_bytes]
    budget = max(p.trunk_bytes, max(runs))
    plan = plan_trunk(runs, budget)
    streamed = sum(runs) - plan.pinned_bytes
    pool = sz.n_experts * sz.n_moe_layers
    slots = p.cache_bytes // sz.expert_slot_bytes if sz.expert_slot_bytes else 0
    hit = min(1.0, slots / pool) if pool else 1.0
    experts = int(sz.expert_bytes_per_token * (1.0 - hit))
    return PresetReads(p.name, streamed, experts, len(plan.pinned), len(runs))
