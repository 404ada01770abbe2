"""The trunk and expert-cache budgets ``k3 tune`` times with and writes into its preset.

Sized to the model and to this machine, never larger than either:

* **the model**: the trunk budget is at most what the model's trunk can use, every layer
  pinned (:func:`trunk_most`: the trunk bytes the shards hold plus one alignment unit a
  layer); the expert cache at most every routed expert of the model at slot size
  (:func:`cache_most`). Sizes are counted from the shards (``sizes_from_index``).
* **the machine**: a budget not given is the ``auto`` preset's split of the memory
  available now (:func:`k3core.run.preset_auto.auto_budget`: a reserve for the tables, the
  run's fixed cost and the system, the whole trunk first, then the cache); on a machine
  below ``auto``'s fixed reserve, what the memory plan leaves under its 95 % line (trunk
  first). Budgets given with ``--trunk-gb``/``--cache-gb`` are kept (cut to the model, with
  a note). Either way a streamed run with the budgets must fit the memory available by the
  same memory plan ``k3 run`` checks, and the trunk must hold one ring slot (the largest
  layer), or tune refuses (exit 2) before any run.

So on an 8 MB model the preset says a few MB, not the engine's 16 GB / 64 GB defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3core.api.errors import K3Error, UsageError
from k3core.api.units import ALIGN, align_up, human
from k3core.model.config import ModelConfig
from k3core.model.sizes import ModelSizes, sizes_from_config, sizes_from_index
from k3core.run.memory_plan import (
    PLAN_LIMIT,
    MemoryPlan,
    MemoryRequest,
    available_bytes,
    plan_memory,
    total_bytes,
)
from k3core.run.preset_auto import auto_budget, run_overhead


@dataclass(frozen=True)
class Budgets:
    """What ``k3 tune`` runs with and writes (bytes), and the limits it respected."""

    trunk_bytes: int
    cache_bytes: int
    trunk_most: int  # the most the model's trunk can use
    cache_most: int  # every routed expert of the model, at slot size
    available: int  # memory available when sized
    planned: int  # the memory plan of a streamed run with these budgets
    how: str  # how they were chosen, for the report
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def trunk_gb(self) -> float:
        return self.trunk_bytes / 1e9

    @property
    def cache_gb(self) -> float:
        return self.cache_bytes / 1e9

    def line(self) -> str:
        return (f"budgets: trunk {human(self.trunk_bytes)} (the model's trunk can use at most "
                f"{human(self.trunk_most)}), expert cache {human(self.cache_bytes)} (every "
                f"expert: {human(self.cache_most)}); a streamed run plans "
                f"{human(self.planned)} of {human(self.available)} available; {self.how}")

    def to_json(self) -> dict[str, Any]:
        return {"trunk_gb": self.trunk_gb, "cache_gb": self.cache_gb,
                "trunk_most_bytes": self.trunk_most, "cache_most_bytes": self.cache_most,
                "available_bytes": self.available, "planned_bytes": self.planned,
                "how": self.how, "notes": list(self.notes)}


def trunk_most(sizes: ModelSizes) -> int:
    """The largest trunk budget the model can use: every layer pinned, each padded."""
    return sizes.trunk_bytes + ALIGN * len(sizes.layer_bytes)


def cache_most(sizes: ModelSizes) -> int:
    """The largest expert cache the model can use: every routed expert, at slot size."""
    return sizes.expert_pool_bytes


def model_sizes(model_dir: Path, cfg: ModelConfig, storage: str | None = None) -> ModelSizes:
    """The model's sizes counted from its shards (planned from the config when the shard
    headers cannot be indexed; the run itself then says why)."""
    from k3core.checkpoint.index import CheckpointIndex
    from k3core.plugins.registry import get_registry

    try:
        backend, _, _ = get_registry().create("storage", storage or "auto", for_path=model_dir)
        with CheckpointIndex.open(model_dir, backend) as index:
            tensors = {n: t.nbytes for n, t in index.tensors.items()}
    except K3Error:
        return sizes_from_config(cfg)
    return sizes_from_index(cfg, tensors)


def size_budgets(cfg: ModelConfig, sizes: ModelSizes, *, trunk_gb: float | None,
                 cache_gb: float | None, prompt_len: int, gen: int, available: int | None = None,
                 total: int | None = None, baseline: int | None = None) -> Budgets:
    """The budgets for ``k3 tune`` (see the module); ``trunk_gb``/``cache_gb`` as given
    (``None``: size them), ``prompt_len`` and ``gen`` the shape of each trial."""
    avail = available_bytes() if available is None else available
    tot = total_bytes() if total is None else total
    t_most, c_most = trunk_most(sizes), cache_most(sizes)
    notes: list[str] = []

    def plan(t: int, c: int) -> MemoryPlan:
        return plan_memory(cfg, MemoryRequest(
            streamed=True, trunk_budget=t, cache_bytes=c, prompt_len=prompt_len, gen=gen,
            incremental=True), sizes=sizes, available=avail, baseline=baseline)

    cache_floor = min((sizes.topk + 1) * sizes.expert_slot_bytes, c_most)
    sized = "the auto preset's split"
    trunk = 0 if trunk_gb is None else _given(trunk_gb, t_most, "--trunk-gb",
                                              "trunk, every layer pinned", notes)
    cache = 0 if cache_gb is None else _given(cache_gb, c_most, "--cache-gb",
                                              "routed experts", notes)
    if trunk_gb is None or cache_gb is None:
        overhead = run_overhead(cfg, prompt_len + gen + 1, baseline=baseline)
        try:
            auto = auto_budget(sizes, overhead=overhead, available=avail, total=tot)
            room_trunk, room_cache = auto.trunk, auto.cache
        except UsageError:  # below auto's fixed reserve: what the plan's 95 % line leaves
            sized = "what the memory plan leaves, below the auto preset's reserve"
            room = int(PLAN_LIMIT * avail) - plan(trunk, cache).total
            room_trunk = max(0, min(room - (cache_floor if cache_gb is None else 0), t_most))
            room_cache = max(0, room - (room_trunk if trunk_gb is None else 0))
        if trunk_gb is None:
            trunk = min(room_trunk, t_most)
        if cache_gb is None:
            cache = min(room_cache, c_most)
        # each cache slot may bring a transient expert buffer beside it (the plan's
        # buffers): what the plan is over its line comes off the sized budgets, the cache's
        # down to its floor first
        for _ in range(8):
            over = plan(trunk, cache).total - int(PLAN_LIMIT * avail)
            if over <= 0:
                break
            if cache_gb is None and cache > cache_floor:
                cache = max(cache_floor, cache - over)
            elif trunk_gb is None and trunk > 0:
                trunk = max(0, trunk - over)
            else:
                break
    given = " and ".join(f for f, v in (("--trunk-gb", trunk_gb), ("--cache-gb", cache_gb))
                         if v is not None) or "k3 tune"
    floor = min(align_up(sizes.largest_layer), t_most)
    if trunk < floor:
        raise UsageError(
            f"{given}: a trunk budget of {human(trunk)} is below one ring slot of this model "
            f"(its largest layer, {human(floor)})" + ("" if trunk_gb is not None else
                                                      f"; this machine has {human(avail)} "
                                                      "available: free some memory"))
    if cache < cache_floor:
        raise UsageError(
            f"{given}: an expert cache of {human(cache)} holds fewer than top-k + 1 = "
            f"{sizes.topk + 1} experts of this model ({human(cache_floor)})"
            + ("" if cache_gb is not None else
               f"; this machine has {human(avail)} available: free some memory"))
    p = plan(trunk, cache)
    if not p.fits():
        raise UsageError(
            f"{given}: a streamed run with trunk {human(trunk)} and expert cache {human(cache)} "
            f"plans {human(p.total)} and this machine has {human(avail)} available; give "
            "smaller budgets, or leave them out and k3 tune sizes them to the model and this "
            "machine")
    if trunk_gb is None and cache_gb is None:
        how = f"sized to the model and the memory available ({sized})"
    elif trunk_gb is not None and cache_gb is not None:
        how = "as given (cut to the model)"
    else:
        how = ("as given (cut to the model); " + ("the expert cache" if cache_gb is None else
               "the trunk") + f" sized to the model and the memory available ({sized})")
    return Budgets(trunk, cache, t_most, c_most, avail, p.total, how, tuple(notes))


def _given(gb: float, most: int, flag: str, what: str, notes: list[str]) -> int:
    if gb * 1e9 <= most:
        return int(gb * 1e9)
    notes.append(f"{flag} {gb:g} is more than this model can use (its {what}: {human(most)}); "
                 f"the preset keeps {most / 1e9:.9g}")
    return most
