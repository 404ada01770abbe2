"""The ``auto`` preset: budgets computed from the memory actually available.

The reference engine's algorithm (docs/engine-behaviours.md §2), written in terms of the model's planned
sizes so it works for any model, not only Kimi K3:

* ``reserve`` = 2 GB + 2 % of available + the model tables (embedding + lm_head) + the rest
  of a run's fixed cost (recurrent state, buffers and KV for a short request, this process);
  ``usable`` = available - reserve.
* Floors: one ring slot (the largest trunk layer) and the smallest expert cache (top-k + 1
  slots). ``usable`` below their sum is refused (``UsageError``, exit 2).
* When the whole trunk (plus 2 % widening headroom) and the cache floor fit, the trunk is
  fully resident and the expert cache takes what is left, never more than every expert of
  the model: a model much smaller than RAM ends up entirely resident.
* Otherwise the pinned trunk is capped so the process stays under 55 % of total memory
  (pinning close to RAM size pushed the reference box into reclaim and ran slower than
  pinning nothing) and the cache gets its floor. A pinned trunk GB is worth ~70 expert-cache
  GB at the margin, so the trunk is served first.

For Kimi K3 this reproduces the reference's constants: a 111 GB full-trunk threshold, a
4.70 GB table reserve, a 2.34 GB ring-slot floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3core.api.errors import UsageError
from k3core.api.units import ALIGN, align_up, human
from k3core.model.config import ModelConfig
from k3core.model.sizes import ModelSizes, sizes_from_config
from k3core.model.state import recurrent_bytes_per_layer
from k3core.run.memory_plan import (
    available_bytes,
    buffer_bytes,
    kv_bytes,
    process_rss,
    total_bytes,
    transient_expert_bytes,
)
from k3core.run.preset import AUTO, Preset

FIXED_RESERVE = 2_000_000_000
RESERVE_SHARE = 0.02
WIDEN_HEADROOM = 0.02
PIN_CAP_SHARE = 0.55
#: the short request ``auto`` reserves room for when none is given (prompt + gen + 1)
DEFAULT_POSITIONS = 64


@dataclass(frozen=True)
class AutoBudget:
    """What ``auto`` chose and why."""

    trunk: int
    cache: int
    available: int
    total: int
    reserved: int
    full_trunk: bool
    all_experts: bool

    @property
    def usable(self) -> int:
        return self.available - self.reserved

    def line(self) -> str:
        what = ("whole trunk resident" if self.full_trunk else
                f"pin capped at {PIN_CAP_SHARE:.0%} of {human(self.total)} total")
        if self.all_experts:
            what += ", every expert cached"
        return (f"auto budget: {human(self.available)} available, {human(self.reserved)} reserved -> "
                f"trunk {human(self.trunk)} / expert cache {human(self.cache)} ({what})")


def run_overhead(cfg: ModelConfig, positions: int = DEFAULT_POSITIONS,
                 incremental: bool = True, baseline: int | None = None) -> int:
    """Fixed cost of a run besides the budgets: state, buffers (the transient expert
    buffers of a visit of ``positions`` rows among them), KV, this interpreter.

    The latent KV cache is counted whatever ``incremental`` says: full recompute holds one
    for the sequence it recomputes (``incremental`` is kept for callers)."""
    state = recurrent_bytes_per_layer(cfg) * cfg.n_kda
    kv = kv_bytes(cfg, positions)
    base = process_rss() if baseline is None else baseline
    sz = sizes_from_config(cfg)
    transient = transient_expert_bytes(sz.n_experts, sz.topk, sz.expert_bytes, positions)
    return state + buffer_bytes(cfg, positions) + transient + kv + base


def auto_budget(sizes: ModelSizes, *, overhead: int, available: int | None = None,
                total: int | None = None) -> AutoBudget:
    """Split the available memory between trunk and expert cache (see the module doc)."""
    avail = available_bytes() if available is None else available
    tot = total_bytes() if total is None else total
    reserved = int(FIXED_RESERVE + RESERVE_SHARE * avail) + sizes.tables_bytes + overhead
    usable = avail - reserved
    slot_floor = align_up(sizes.largest_layer)
    cache_floor = (sizes.topk + 1) * sizes.expert_slot_bytes
    if usable < slot_floor + cache_floor:
        raise UsageError(
            f"auto budget below the floor: {human(avail)} available, {human(reserved)} reserved "
            f"leaves {human(max(usable, 0))}, and one ring slot ({human(slot_floor)}) plus the "
            f"smallest expert cache ({human(cache_floor)}) need {human(slot_floor + cache_floor)}; "
            "try --preset ultra (streams the model tables too) or free some memory"
        )
    whole = sizes.trunk_bytes + ALIGN * len(sizes.layer_bytes)
    full = align_up(int(whole * (1 + WIDEN_HEADROOM)))
    if usable - cache_floor >= full:
        cache = min(usable - full, max(sizes.expert_pool_bytes, cache_floor))
        return AutoBudget(full, cache, avail, tot, reserved, True,
                          cache >= sizes.expert_pool_bytes)
    cap = int(PIN_CAP_SHARE * tot) - sizes.tables_bytes - overhead - cache_floor
    trunk = max(slot_floor, min(usable - cache_floor, cap))
    return AutoBudget(trunk, cache_floor, avail, tot, reserved, False, False)


def auto_preset(sizes: ModelSizes | None = None, *, cfg: ModelConfig | None = None,
                available: int | None = None, total: int | None = None,
                overhead: int | None = None) -> Preset:
    """The ``auto`` preset for ``sizes`` (Kimi K3's planned sizes when neither is given)."""
    if cfg is None:
        from k3core.model.shapes import size_config

        cfg = ModelConfig.from_json_dict(size_config("real"), source="Kimi K3 (planned)")
    sz = sizes or sizes_from_config(cfg)
    ob = run_overhead(cfg) if overhead is None else overhead
    b = auto_budget(sz, overhead=ob, available=available, total=total)
    return Preset(
        name=AUTO,
        description="computed from the memory available now",
        trunk_gb=b.trunk / 1e9,
        cache_gb=b.cache / 1e9,
        notes=b.line(),
    ).with_origin("computed")
