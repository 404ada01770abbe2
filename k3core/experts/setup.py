"""Build the expert source of a run: the slot cache sized by ``--cache-gb`` and a policy.

Without ``--cache-gb`` the cache may hold every routed expert of the bound layers (each is
read once, on first use, and kept); the memory plan counts that, and refuses when it does
not fit, so a large model needs a budget (a preset sets one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3core.api.errors import UsageError
from k3core.api.units import gb_bytes
from k3core.checkpoint.index import CheckpointIndex
from k3core.experts.cache import ExpertCache
from k3core.experts.locator import ExpertLocator
from k3core.experts.trace import TraceRecorder
from k3core.model import sizes
from k3core.model.config import ModelConfig
from k3core.plugins.registry import Registry


@dataclass
class CacheOptions:
    cache_gb: float | None = None
    policy: str = "auto"
    policy_options: dict[str, Any] = field(default_factory=dict)
    trace_dir: Path | None = None  # --dump-cache-trace
    readers: int = 4


def expert_slots(cfg: ModelConfig, n_layers: int, slot_bytes: int, cache_gb: float | None) -> int:
    """Slots for ``cache_gb`` (decimal GB), at most every expert; refuses fewer than top-k + 1."""
    moe = sum(1 for L in range(n_layers) if not cfg.is_dense(L))
    total = moe * cfg.n_experts
    stride = sizes.slot_bytes(slot_bytes)
    if cache_gb is None:
        return total
    if not cache_gb >= 0:
        raise UsageError(f"--cache-gb must be a non-negative number, got {cache_gb}")
    slots = sizes.cache_slots(gb_bytes(cache_gb), slot_bytes, total)
    if slots < cfg.topk + 1:
        need = (cfg.topk + 1) * stride / 1e9
        raise UsageError(
            f"--cache-gb {cache_gb:g} gives {slots} expert slots of {stride / 1e6:.2f} MB; "
            f"at least top-k + 1 = {cfg.topk + 1} are needed ({need:.3f} GB)"
        )
    return slots


def build_expert_cache(
    cfg: ModelConfig, index: CheckpointIndex, n_layers: int, reg: Registry, opts: CacheOptions
) -> tuple[ExpertCache | None, str, str]:
    """``(cache, policy name, note)``; ``None`` when the bound layers have no MoE."""
    if all(cfg.is_dense(L) for L in range(n_layers)):
        return None, "none", ""
    locator = ExpertLocator(cfg, index)
    slot_bytes = locator.max_bytes(range(n_layers))
    slots = expert_slots(cfg, n_layers, slot_bytes, opts.cache_gb)
    policy, name, note = reg.create(
        "cache",
        opts.policy,
        capacity=slots,
        n_layers=cfg.n_layers,
        n_experts=cfg.n_experts,
        topk=cfg.topk,
        **opts.policy_options,
    )
    recorder = TraceRecorder(cfg.n_layers, cfg.n_experts) if opts.trace_dir is not None else None
    cache = ExpertCache(index, locator, policy, slots, slot_bytes, readers=opts.readers, recorder=recorder)
    return cache, name, note
