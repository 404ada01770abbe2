"""Binding a model to its checkpoint and the chosen plugins (the engine's lower half).

:func:`bind` resolves the kernel backend, the storage backend and the expert source through
the registry (an explicit choice never falls back), reads the config, indexes the shards and
binds the trunk. The forward pass (``k3core.model.forward``) then runs on ``Bound.model``;
nothing below asks which plugins were chosen. :class:`k3core.run.engine.Engine` is a
``Bound`` with the calls a caller makes (generate, stream, logits, sessions).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from k3core.api.errors import UsageError
from k3core.api.experts import ExpertSource, InMemoryExperts
from k3core.api.kernels import KernelBackend
from k3core.api.storage import StorageBackend
from k3core.checkpoint.bounds import check_bind_shapes
from k3core.checkpoint.index import CheckpointIndex
from k3core.experts.setup import CacheOptions, build_expert_cache
from k3core.model.config import ModelConfig, load_config
from k3core.model.forward import Model, lookahead_mode
from k3core.model.sources import ModelTables, ResidentTrunk, TrunkSource, expert_from_reader
from k3core.plugins.registry import get_registry
from k3core.run.model_dir import config_path
from k3core.trunk.source import check_trunk_options, open_streamed_trunk
from k3core.trunk.tables import StreamedTables

if TYPE_CHECKING:
    from k3core.experts.cache import ExpertCache
    from k3core.tokenizer.encoding import Tokenizer

B = TypeVar("B", bound="Bound")


@dataclass
class EngineOptions:
    model_dir: Path
    config_path: Path | None = None
    layers: int | None = None
    backend: str = "auto"
    storage: str = "auto"
    cache_policy: str = "auto"
    threads: int | None = None
    # packed trunk (k3core.trunk.source): stream from trunk_dir within trunk_gb (decimal GB)
    trunk_dir: Path | None = None
    trunk_gb: float | None = None
    ring: int | None = None
    ultra_low_memory: bool = False
    verify_trunk: bool = False
    cache: CacheOptions = field(default_factory=CacheOptions)
    lookahead: str = "off"  # router lookahead: off, on, attn, out (docs/expert-cache.md)
    #: ids per forward pass of a prompt (Model.prefill_chunk; None: one pass)
    prefill_chunk: int | None = None


@dataclass
class Bound:
    """A model bound to its checkpoint and plugins; :class:`k3core.run.engine.Engine` adds
    the calls that use it."""

    cfg: ModelConfig
    model: Model
    index: CheckpointIndex
    kernels: KernelBackend
    storage: StorageBackend
    experts: ExpertSource
    names: dict[str, str]
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    trunk_lines: list[str] = field(default_factory=list)
    step_log: Any = None
    tokenizer: Tokenizer | None = None
    incremental: bool = True
    closed: bool = False

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



def read_model_config(opts: EngineOptions) -> ModelConfig:
    cfg = load_config(config_path(opts.model_dir, opts.config_path))
    if opts.layers is not None and not 1 <= opts.layers <= cfg.n_layers:
        raise UsageError(f"--layers must be in 1..{cfg.n_layers}, got {opts.layers}")
    return cfg


def bind(
    opts: EngineOptions,
    cfg: ModelConfig | None = None,
    on_layer_bound: Callable[[int], None] | None = None,
    cls: type[B] = Bound,  # type: ignore[assignment]
) -> B:
    """Resolve plugins, index the checkpoint and bind the trunk (resident)."""
    if not opts.model_dir.is_dir():
        raise UsageError(f"model directory {opts.model_dir} does not exist")
    cfg = cfg or read_model_config(opts)
    check_trunk_options(opts.trunk_dir, opts.trunk_gb, opts.ring, opts.ultra_low_memory)
    reg = get_registry()
    notes: list[str] = []
    kernels, kname, note = reg.create("kernel", opts.backend)
    if note:
        notes.append(note)
    if opts.threads is not None:
        kernels.set_threads(opts.threads)
    storage, sname, note = reg.create("storage", opts.storage)
    if note:
        notes.append(note)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    index = CheckpointIndex.open(opts.model_dir, storage)
    timings["index"] = time.perf_counter() - t0
    n_layers = opts.layers or cfg.n_layers
    t0 = time.perf_counter()
    trunk: TrunkSource | None = None
    cache: ExpertCache | None = None
    trunk_lines: list[str] = []
    opts.cache.policy = opts.cache_policy
    try:
        check_bind_shapes(cfg, index, n_layers)  # from the headers, before any tensor is read
        # the cache first: its arena is faulted in on its own thread while the trunk binds
        cache, pname, note = build_expert_cache(cfg, index, n_layers, reg, opts.cache)
        if opts.trunk_dir is not None:
            trunk, trunk_lines = open_streamed_trunk(
                opts.trunk_dir, cfg, index, storage, n_layers, opts.trunk_gb, opts.ring,
                storage_name=sname, verify=opts.verify_trunk, progress=on_layer_bound)
        else:
            trunk = ResidentTrunk(cfg, index, n_layers, progress=on_layer_bound)
        if opts.ultra_low_memory:
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
    if note:
        notes.append(note)
    experts: ExpertSource = cache or InMemoryExperts(lambda L, e: expert_from_reader(cfg, index, L, e))
    model = Model(cfg, kernels, trunk, tables, experts, n_layers=n_layers)
    model.shared_kda_slot = opts.ultra_low_memory
    model.lookahead = lookahead_mode(opts.lookahead)
    model.prefill_chunk = opts.prefill_chunk
    names = {"kernel": kname, "storage": sname, "cache": pname,
             "trunk": "streamed" if opts.trunk_dir is not None else "resident"}
    # the objects loading made, collected now: left pending, the full collection they
    # trigger lands in the first forward pass (40-50 ms of a 128-id medium prefill)
    gc.collect()
    return cls(cfg, model, index, kernels, storage, experts, names, notes, timings, trunk_lines)
