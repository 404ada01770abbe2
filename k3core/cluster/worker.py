"""One expert worker: its own storage backend, index and expert cache over its own files.

``ExpertWorker`` is a plain class (``pool`` runs it as a Ray actor): ``open`` binds a
model directory on the worker's machine with the kernel backend, storage backend and cache
policy the head resolved, ``digest`` checksums its share, ``compute`` runs one MoE layer's
owned experts over the latent rows the head sent. Each output is the kernel backend's
``situ_mlp`` over exactly the rows the head would have used (same bytes, same order), so
it is byte-identical to computing it on the head.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.api.experts import ExpertSource
from k3core.api.kernels import KernelBackend
from k3core.checkpoint.index import CheckpointIndex
from k3core.cluster.share import ShareDigest, share_digest
from k3core.experts.locator import ExpertLocator
from k3core.experts.setup import CacheOptions, build_expert_cache
from k3core.model import sizes
from k3core.model.config import ModelConfig, load_config
from k3core.model.local_experts import serve_experts
from k3core.plugins.registry import get_registry


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker binds: the head's resolved choices and the worker's share."""

    model_dir: str
    config: str | None
    n_layers: int
    kernel: str
    storage: str
    cache_policy: str
    cache_gb: float | None  # this worker's cache; None holds its whole share
    threads: int | None
    owned: dict[int, list[int]]


class ExpertWorker:
    """Serves the routed experts of one share (see the module docstring)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.spec: WorkerSpec | None = None
        self.cfg: ModelConfig | None = None
        self.kernels: KernelBackend | None = None
        self.index: CheckpointIndex | None = None
        self.source: ExpertSource | None = None
        self.locator: ExpertLocator | None = None
        self._owned: dict[int, set[int]] = {}
        self._step = -1

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}

    def open(self, spec: WorkerSpec) -> dict[str, Any]:
        """Bind ``spec`` (closing whatever was bound); returns the names it resolved."""
        self.close()
        root = Path(spec.model_dir)
        if not root.is_dir():
            raise UsageError(f"model directory {root} does not exist on this worker")
        cfg = load_config(Path(spec.config) if spec.config else root / "config.json")
        reg = get_registry()
        kernels, kname, _ = reg.create("kernel", spec.kernel)
        if spec.threads is not None:
            kernels.set_threads(spec.threads)
        storage, sname, _ = reg.create("storage", spec.storage)
        index = CheckpointIndex.open(root, storage)
        try:
            locator = ExpertLocator(cfg, index)
            owned = sum(len(v) for v in spec.owned.values())
            cache_gb = spec.cache_gb
            if cache_gb is None:  # room for the whole share (and the top-k + 1 minimum)
                stride = sizes.slot_bytes(locator.max_bytes(range(spec.n_layers)))
                cache_gb = max(owned, cfg.topk + 1) * stride / 1e9 + 1e-9
            opts = CacheOptions(cache_gb=cache_gb, policy=spec.cache_policy)
            cache, pname, _ = build_expert_cache(cfg, index, spec.n_layers, reg, opts)
        except BaseException:
            index.close()
            raise
        if cache is None:
            index.close()
            raise UsageError("the bound layers have no MoE layer: nothing for an expert worker")
        self.spec, self.cfg, self.kernels, self.index = spec, cfg, kernels, index
        self.source, self.locator = cache, locator
        self._owned = {L: set(es) for L, es in spec.owned.items()}
        return {"kernel": kname, "storage": sname, "cache": pname,
                "slots": getattr(cache, "capacity", 0), **self.describe()}

    def digest(self) -> ShareDigest:
        assert self.index is not None and self.locator is not None and self.spec is not None
        return share_digest(self.index, self.locator, self.spec.owned)

    def compute(self, step: int, layer: int, experts: list[int], rows: list[np.ndarray],
                z: np.ndarray) -> list[np.ndarray]:
        """Outputs of ``experts`` of ``layer``: expert ``experts[i]`` over ``z[rows[i]]``
        (``step`` counts the head's forward passes: the cache's hit accounting)."""
        if self.source is None or self.cfg is None or self.kernels is None:
            raise K3Error(f"expert worker {self.rank} has no model bound")
        mine = self._owned.get(layer, set())
        stray = [e for e in experts if e not in mine]
        if stray:
            raise K3Error(f"expert worker {self.rank} does not own experts {stray} of layer {layer}")
        where = {e: i for i, e in enumerate(experts)}
        outs: list[np.ndarray | None] = [None] * len(experts)

        def put(e: int, y: np.ndarray) -> None:
            outs[where[e]] = y

        requests = [e for e, r in zip(experts, rows, strict=True) for _ in range(len(r))]
        if step != self._step:
            self.source.begin_step()
            self._step = step
        # the served experts as the head's own executor serves them (each one's situ_mlp bits)
        serve_experts(self.source, self.kernels, (self.cfg.situ_b1, self.cfg.situ_b2), layer,
                      requests, dict(zip(experts, rows, strict=True)), z, put)
        missing = [e for e, o in zip(experts, outs, strict=True) if o is None]
        if missing:
            raise K3Error(f"expert worker {self.rank}: experts {missing} of layer {layer} were not served")
        return [o for o in outs if o is not None]

    def stats(self) -> dict[str, Any]:
        s = self.source.stats if self.source is not None else None
        if s is None:
            return {}
        return {"requests": s.requests, "hits": s.hits, "misses": s.misses,
                "evictions": s.evictions, "bytes_read": s.bytes_read,
                "read_seconds": s.read_seconds, "drops": s.drops}

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
        if self.index is not None:
            self.index.close()
        self.source = self.index = None
