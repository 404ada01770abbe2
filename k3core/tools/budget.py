"""``k3 budget``: what stays resident, what streams, and what each preset would plan.

Tensors are classified by name from the checkpoint index (the reference's rule, docs/engine-behaviours.md §9):
routed experts (``block_sparse_moe.experts.E.*``) stream; everything else of a layer is
trunk, shared experts included (they run on every token); the embedding, final norms and
lm_head are the model tables; tensors outside the text model (vision) are counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from k3core.api.errors import UsageError
from k3core.api.storage import StorageBackend
from k3core.api.units import human
from k3core.checkpoint.index import CheckpointIndex
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.sizes import ModelSizes, sizes_from_index
from k3core.run.memory_plan import MemoryPlan, MemoryRequest, kv_bytes, plan_memory
from k3core.run.presets import Preset


@dataclass
class Budget:
    model_dir: Path
    cfg: ModelConfig
    sizes: ModelSizes
    shards: int
    tensors: int
    total_bytes: int
    shared_expert_bytes: int
    expert_total_bytes: int
    expert_count: int
    expert_size_range: tuple[int, int]
    other_bytes: int
    other_count: int
    plans: list[tuple[str, MemoryPlan | None, str]] = field(default_factory=list)

    @property
    def largest_layer(self) -> int:
        lb = self.sizes.layer_bytes
        return lb.index(max(lb)) if lb else 0

    def to_json(self) -> dict[str, Any]:
        lb = self.sizes.layer_bytes
        return {
            "model_dir": str(self.model_dir), "shards": self.shards, "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "trunk_bytes": self.sizes.trunk_bytes, "trunk_layer_bytes": list(lb),
            "trunk_layer_min": min(lb, default=0), "trunk_layer_max": max(lb, default=0),
            "trunk_layer_mean": mean(lb) if lb else 0, "largest_layer": self.largest_layer,
            "shared_expert_bytes": self.shared_expert_bytes,
            "tables_bytes": self.sizes.tables_bytes,
            "expert_bytes": self.sizes.expert_bytes, "expert_count": self.expert_count,
            "expert_total_bytes": self.expert_total_bytes,
            "expert_bytes_per_token": self.sizes.expert_bytes_per_token,
            "other_bytes": self.other_bytes, "other_tensors": self.other_count,
            "kv_bytes_per_position": kv_bytes(self.cfg, 1),
            "plans": [{"preset": n, "total_bytes": p.total if p else None,
                       "kv_cache_bytes": p.kv_cache if p else None,
                       "available_bytes": p.available if p else None,
                       "fits": p.fits() if p else False, "note": note}
                      for n, p, note in self.plans],
        }

    def lines(self) -> list[str]:
        s = self.sizes
        lb = s.layer_bytes
        out = [
            f"model: {self.model_dir} ({self.shards} shards, {self.tensors} tensors, "
            f"{human(self.total_bytes)})",
            self.cfg.describe(),
            f"resident trunk   : {human(s.trunk_bytes)} over {len(lb)} layers (per layer min "
            f"{human(min(lb, default=0))} / mean {human(mean(lb) if lb else 0)} / max "
            f"{human(max(lb, default=0))}; largest: layer {self.largest_layer})",
            f"  shared experts : {human(self.shared_expert_bytes)} of it (they run on every token)",
            f"model tables     : {human(s.tables_bytes)} (embedding, final norms, lm_head)",
            f"routed experts   : {human(self.expert_total_bytes)} STREAMED ({self.expert_count} "
            f"experts x {human(s.expert_bytes)})",
            f"  per token      : {human(s.expert_bytes_per_token)} with no cache hits (top-{s.topk} x "
            f"{s.n_moe_layers} MoE layers x {human(s.expert_bytes)})",
        ]
        lo, hi = self.expert_size_range
        if lo != hi:
            out.append(f"  WARNING: routed experts differ in size ({lo} to {hi} bytes)")
        if self.other_count:
            out.append(f"not text model   : {human(self.other_bytes)} ({self.other_count} tensors, "
                       "never read)")
        planned = next((plan for _, plan, _ in self.plans if plan is not None), None)
        if planned is not None:
            out.append(f"KV cache (latent): {human(planned.kv_cache)} for {planned.positions} "
                       f"positions ({human(kv_bytes(self.cfg, 1))} a position; every decoding "
                       "mode holds it, full recompute included)")
        if self.plans:
            out.append("memory each preset would plan:")
            out.append(f"  {'preset':<12}{'trunk':>10}{'cache':>10}{'total':>11}  fits?")
            for name, plan, note in self.plans:
                if plan is None:
                    out.append(f"  {name:<12}{'':>31}  {note}")
                    continue
                fits = "yes" if plan.fits() else f"no ({human(plan.available)} available)"
                out.append(f"  {name:<12}{human(plan.trunk):>10}{human(plan.expert_cache):>10}"
                           f"{human(plan.total):>11}  {fits}")
        return out


def budget_report(model_dir: str | Path, storage: StorageBackend,
                  config: str | Path | None = None) -> Budget:
    """Index ``model_dir`` and classify every tensor."""
    root = Path(model_dir)
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory")
    cfg = load_config(config or root)
    with CheckpointIndex.open(root, storage) as index:
        sizes = {n: t.nbytes for n, t in index.tensors.items()}
        n_shards = len(index.shards)
        total = index.total_bytes
        elem = (index.info(names.EMBED).nbytes // max(cfg.vocab * cfg.hidden, 1)
                if names.EMBED in index else 2)
    shared = experts = other = other_n = 0
    per_expert: dict[tuple[int, str], int] = {}
    for name, nbytes in sizes.items():
        split = names.split_layer_name(name)
        if split is None:
            if name not in names.MODEL_TABLES:
                other += nbytes
                other_n += 1
            continue
        layer, suffix = split
        if layer >= cfg.n_layers:
            other += nbytes
            other_n += 1
            continue
        m = names.EXPERT_RE.match(suffix)
        if m:
            experts += nbytes
            key = (layer, m.group(1))
            per_expert[key] = per_expert.get(key, 0) + nbytes
        elif ".shared_experts." in f".{suffix}":
            shared += nbytes
    ms = sizes_from_index(cfg, sizes, elem or 2)
    rng = (min(per_expert.values(), default=0), max(per_expert.values(), default=0))
    return Budget(root, cfg, ms, n_shards, len(sizes), total, shared, experts, len(per_expert),
                  rng, other, other_n)


def add_plans(b: Budget, presets: list[Preset], *, prompt_len: int, gen: int,
              incremental: bool, available: int | None = None, baseline: int | None = None,
              total: int | None = None) -> None:
    """Plan the memory of a streamed run under each preset (and ``auto``)."""
    for p in presets:
        plan = plan_memory(b.cfg, MemoryRequest(
            streamed=True, trunk_budget=p.trunk_bytes, cache_bytes=p.cache_bytes,
            prompt_len=prompt_len, gen=gen, incremental=incremental, ultra=p.ultra_low_memory),
            sizes=b.sizes, available=available, baseline=baseline)
        b.plans.append((p.name, plan, ""))
    from k3core.run.preset_auto import auto_preset, run_overhead

    overhead = run_overhead(b.cfg, prompt_len + gen + 1, incremental, baseline)
    try:
        auto = auto_preset(b.sizes, cfg=b.cfg, available=available, total=total,
                           overhead=overhead)
    except UsageError as exc:
        b.plans.append(("auto", None, str(exc).split(";")[0]))
        return
    plan = plan_memory(b.cfg, MemoryRequest(
        streamed=True, trunk_budget=auto.trunk_bytes, cache_bytes=auto.cache_bytes,
        prompt_len=prompt_len, gen=gen, incremental=incremental),
        sizes=b.sizes, available=available, baseline=baseline)
    b.plans.append(("auto", plan, ""))
