"""Binding a plan to its checkpoint and plugins: the engine stage's work.

:func:`bind` creates the plugins the plan resolved (each by the name the plan picked: an
``auto`` choice is made once, in :mod:`k3core.run.plan`, never again here), indexes the
shards, builds the expert cache, opens the trunk source and the model tables, and builds the
:class:`~k3core.model.forward.Model`. The forward pass then runs on ``Bound.model``; nothing
below asks which plugins were chosen. :class:`k3core.run.engine.Engine` is a ``Bound`` with
the calls a caller makes (generate, stream, logits, sessions), and
:func:`k3core.run.engine.open_engine` the one way to get one.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from k3core.api.errors import K3Error
from k3core.api.experts import ExpertSource, ExpertWeights, InMemoryExperts
from k3core.api.kernels import KernelBackend
from k3core.api.storage import StorageBackend
from k3core.checkpoint.bounds import check_bind_shapes
from k3core.checkpoint.index import CheckpointIndex
from k3core.experts.setup import build_expert_cache
from k3core.model.config import ModelConfig
from k3core.model.forward import Model, lookahead_mode
from k3core.model.sources import ModelTables, ResidentTrunk, TrunkSource, expert_from_reader
from k3core.plugins.registry import get_registry
from k3core.run.plan import EnginePlan, Plugins
from k3core.trunk.source import open_streamed_trunk
from k3core.trunk.tables import StreamedTables

if TYPE_CHECKING:
    from k3core.experts.cache import ExpertCache
    from k3core.tokenizer.encoding import Tokenizer
    from k3core.trunk.source import StepTrunkLog

B = TypeVar("B", bound="Bound")


@dataclass(kw_only=True)
class Bound:
    """A model bound to its checkpoint and plugins, as its ``plan`` says;
    :class:`k3core.run.engine.Engine` adds the calls that use it."""

    plan: EnginePlan
    model: Model
    index: CheckpointIndex
    kernels: KernelBackend
    storage: StorageBackend
    experts: ExpertSource
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    trunk_lines: list[str] = field(default_factory=list)
    #: the per-step trunk figures of a ``k3 run`` (the runner sets it)
    step_log: StepTrunkLog | None = None
    closed: bool = False

    @property
    def cfg(self) -> ModelConfig:
        return self.plan.cfg

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.plan.tokenizer

    @property
    def incremental(self) -> bool:
        return self.plan.incremental

    @property
    def names(self) -> dict[str, str]:
        """The plugins the plan resolved, by role (``cache`` is ``none`` without a MoE layer)."""
        p = self.plan
        return {"kernel": p.plugins.kernel, "storage": p.plugins.storage,
                "cache": p.plugins.cache if p.has_moe else "none",
                "trunk": "streamed" if p.streamed else "resident"}

    @property
    def settings_line(self) -> str:
        n = self.names
        return f"k3: kernel={n['kernel']} storage={n['storage']} cache={n['cache']}"

    @property
    def eos_ids(self) -> set[int]:
        """Ids that end a sequence: the tokenizer's ``[EOS]`` and config's ``eos_token_id``."""
        out = set()
        tok = self.tokenizer
        if tok is not None and "[EOS]" in tok.special_tokens:
            out.add(tok.special_tokens["[EOS]"])
        if self.cfg.eos_token_id is not None:
            out.add(int(self.cfg.eos_token_id))
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.model.close()
        self.experts.close()
        self.model.trunk.close()
        self.index.close()


def _elsewhere(layer: int, expert: int) -> ExpertWeights:
    raise K3Error(f"routed expert {layer}/{expert} was asked of the head; the expert workers "
                  "serve them (remote_experts)")


def open_checkpoint(model_dir: Path, plugins: Plugins, threads: int | None
                    ) -> tuple[KernelBackend, StorageBackend, CheckpointIndex]:
    """The kernel and storage backends the plan resolved (created by name) and ``model_dir``
    indexed through that storage backend: what every engine opens first (:func:`bind`), and
    all a cluster's expert worker opens besides its expert cache (``k3core.cluster.worker``,
    with the plugins the head's plan resolved)."""
    reg = get_registry()
    kernels, _, _ = reg.create("kernel", plugins.kernel)
    if threads is not None:
        kernels.set_threads(threads)
    storage, _, _ = reg.create("storage", plugins.storage)
    return kernels, storage, CheckpointIndex.open(model_dir, storage)


def bind(plan: EnginePlan, cls: type[B],
         on_layer_bound: Callable[[int], None] | None = None) -> B:
    """Create the plan's plugins, index the checkpoint, build the expert cache and the trunk
    source, and the model on them: a ``cls`` (a :class:`Bound`)."""
    cfg, s, picked = plan.cfg, plan.merged.settings, plan.plugins
    reg = get_registry()
    notes = [n for n in (picked.notes.get("kernel"), picked.notes.get("storage")) if n]
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    kernels, storage, index = open_checkpoint(plan.model_dir, picked, s.threads)
    timings["index"] = time.perf_counter() - t0
    n_layers = plan.n_layers
    t0 = time.perf_counter()
    trunk: TrunkSource | None = None
    cache: ExpertCache | None = None
    trunk_lines: list[str] = []
    try:
        check_bind_shapes(cfg, index, n_layers)  # from the headers, before any tensor is read
        # the cache first: its arena is faulted in on its own thread while the trunk binds
        if not plan.request.remote_experts:  # else the cluster's workers serve them
            cache, _, _ = build_expert_cache(cfg, index, n_layers, reg, plan.cache_options())
        if plan.request.trunk is not None:
            trunk, trunk_lines = open_streamed_trunk(
                plan.request.trunk, cfg, index, storage, n_layers, plan.trunk_gb,
                plan.request.trunk_ring, storage_name=picked.storage,
                verify=plan.request.verify_trunk, progress=on_layer_bound)
        else:
            trunk = ResidentTrunk(cfg, index, n_layers, progress=on_layer_bound)
        if s.ultra_low_memory:
            tables: ModelTables = StreamedTables(cfg, index, trunk=trunk)
        else:  # embedding rows on demand, the head resident
            tables = ModelTables(cfg, index)
        timings["bind"] = time.perf_counter() - t0
        timings["arena"] = cache.await_arena() if cache is not None else 0.0
    except BaseException:
        if cache is not None:
            cache.close()
        if trunk is not None:
            trunk.close()
        index.close()
        raise
    if cache is not None and picked.notes.get("cache"):
        notes.append(picked.notes["cache"])
    experts: ExpertSource = cache or InMemoryExperts(
        _elsewhere if plan.request.remote_experts else
        lambda L, e: expert_from_reader(cfg, index, L, e))
    model = Model(cfg, kernels, trunk, tables, experts, n_layers=n_layers)
    model.shared_kda_slot = s.ultra_low_memory
    model.lookahead = lookahead_mode(s.lookahead)
    model.prefill_chunk = plan.prefill_chunk
    # the objects loading made, collected now: left pending, the full collection they
    # trigger lands in the first forward pass (40-50 ms of a 128-id medium prefill)
    gc.collect()
    return cls(plan=plan, model=model, index=index, kernels=kernels, storage=storage,
               experts=experts, notes=plan.notes + notes, timings=timings,
               trunk_lines=trunk_lines)
