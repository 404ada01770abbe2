"""Build the expert source of a run: the slot cache sized by ``--cache-gb`` and a policy.

Without ``--cache-gb`` the cache may hold every routed expert of the bound layers (each is
read once, on first use, and kept); the memory plan counts that, and refuses when it does
not fit, so a large model needs a budget (a preset sets one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import UsageError, param
from k3core.api.units import check_gb, gb_bytes
from k3core.checkpoint.index import CheckpointIndex
from k3core.experts.cache import ExpertCache
from k3core.experts.locator import ExpertLocator
from k3core.experts.readers import device_readers
from k3core.experts.trace import HIST_NAME, TraceError, TraceRecorder, read_hist, read_trace
from k3core.model import sizes
from k3core.model.config import ModelConfig
from k3core.plugins.registry import Registry


@dataclass(kw_only=True)
class CacheOptions:
    """The expert cache a run asks for: its budget, policy (and the policy's options), where
    it records its trace, its reader threads."""

    cache_gb: float | None = None
    policy: str = "auto"
    policy_options: dict[str, Any] = field(default_factory=dict)
    trace_dir: Path | None = None  # --dump-cache-trace
    readers: int | None = None  # None: sized by the shards' device (k3core.experts.readers)


def expert_slots(cfg: ModelConfig, n_layers: int, slot_bytes: int, cache_gb: float | None) -> int:
    """Slots for ``cache_gb`` (decimal GB), at most every expert; refuses fewer than top-k + 1."""
    moe = sum(1 for L in range(n_layers) if not cfg.is_dense(L))
    total = moe * cfg.n_experts
    stride = sizes.slot_bytes(slot_bytes)
    if cache_gb is None:
        return total
    check_gb(cache_gb, param("cache_gb"))
    slots = sizes.cache_slots(gb_bytes(cache_gb), slot_bytes, total)
    if slots < cfg.topk + 1:
        need = (cfg.topk + 1) * stride / 1e9
        raise UsageError(
            f"{param('cache_gb')} {cache_gb:g} gives {slots} expert slots of "
            f"{stride / 1e6:.2f} MB; "
            f"at least top-k + 1 = {cfg.topk + 1} are needed ({need:.3f} GB)"
        )
    return slots


def check_replay_trace(cfg: ModelConfig, policy: str, trace: object) -> None:
    """``cache_trace`` only with ``cache_policy`` replay, and only a trace of this model.

    A trace of another model is caught by its ``expert_hist.json`` (written beside every
    trace k3 records: the recording model's layer and expert counts), by layers or experts
    out of this model's range, and by layer visits that are not whole positions of top-k.
    """
    if policy != "replay":
        raise UsageError(f"{param('cache_trace')} is read only by {param('cache_policy')} "
                         f"replay (this run uses '{policy}'): add {param('cache_policy')} "
                         f"replay, or drop {param('cache_trace')}")
    if not isinstance(trace, (str, Path)):
        return
    path = Path(trace)
    pairs = read_trace(path, n_layers=cfg.n_layers, n_experts=cfg.n_experts)
    hist_path = path.parent / HIST_NAME
    if hist_path.is_file():
        hist = read_hist(hist_path)
        if (hist["n_layers"], hist["n_experts"]) != (cfg.n_layers, cfg.n_experts):
            raise TraceError(f"{param('cache_trace')} {path}: recorded from a model with "
                             f"{hist['n_layers']} layers and {hist['n_experts']} experts "
                             f"({hist_path}); this model has {cfg.n_layers} and "
                             f"{cfg.n_experts}: a trace of another model")
    layers = pairs[:, 0]
    cuts = np.r_[0, np.flatnonzero(np.diff(layers)) + 1, len(layers)]
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        if (e - s) % cfg.topk:
            raise TraceError(f"{param('cache_trace')} {path}: the visit of layer "
                             f"{int(layers[s])} at "
                             f"request {int(s)} has {int(e - s)} requests, not a multiple of "
                             f"this model's top-k {cfg.topk}: a trace of another model")


def build_expert_cache(
    cfg: ModelConfig, index: CheckpointIndex, n_layers: int, reg: Registry, opts: CacheOptions
) -> tuple[ExpertCache | None, str, str]:
    """``(cache, policy name, note)``; ``None`` when the bound layers have no MoE."""
    if "trace" in opts.policy_options:
        check_replay_trace(cfg, opts.policy, opts.policy_options["trace"])
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
    if opts.readers is not None:
        readers, why = opts.readers, "--readers"
    else:
        readers, why = device_readers(index.shards[0] if index.shards else index.model_dir)
    cache = ExpertCache(index, locator, policy, slots, slot_bytes, readers=readers, recorder=recorder)
    cache.readers_why = why
    return cache, name, note
