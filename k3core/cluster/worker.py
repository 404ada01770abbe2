"""One expert worker: its own storage backend, index and expert cache over its own files.

``ExpertWorker`` is a plain class (``pool`` runs it as a Ray actor): ``open`` binds a
model directory on the worker's machine with the kernel backend, storage backend and cache
policy the head resolved, ``digest`` checksums its share, ``compute`` runs one MoE layer's
owned experts over the latent rows the head sent. Each output is the kernel backend's
``situ_mlp`` over exactly the rows the head would have used (same bytes, same order), so
it is byte-identical to computing it on the head.

The model directory is the head's path (a whole checkpoint on every node), or, with an
expert share (``WorkerSpec.share``, ``k3 shard-experts``), ``worker-i`` under the node's
``$K3_EXPERT_SHARES`` or the head's ``--expert-shares`` directory, checked against the
head's record before anything is bound (:func:`k3core.cluster.shares.verify_share`). A
worker that Ray restarted holds nothing: ``compute`` raises :class:`WorkerNotOpen` until
the head opens it again.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.api.experts import ExpertSource
from k3core.api.kernels import KernelBackend
from k3core.checkpoint.index import CheckpointIndex
from k3core.cluster.share import ShareDigest, share_digest
from k3core.cluster.shares import ShareExpectation, share_root, verify_share, worker_name
from k3core.experts.locator import ExpertLocator
from k3core.experts.setup import CacheOptions, build_expert_cache
from k3core.model import sizes
from k3core.model.config import ModelConfig, load_config
from k3core.model.local_experts import serve_experts
from k3core.plugins.registry import get_registry
from k3core.run.binding import open_checkpoint
from k3core.run.plan import Plugins


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
    #: an expert share to read instead of ``model_dir`` (its directory of shares, and what
    #: the head expects of it); ``None`` reads the whole checkpoint at ``model_dir``
    share: ShareExpectation | None = None
    share_dir: str | None = None
    #: a test hook (:func:`hold_point`): a directory of arm files; ``None`` in every real run
    hold_dir: str | None = None


class WorkerNotOpen(K3Error):
    """A worker with nothing bound (Ray restarted it): the head opens it again and retries."""


#: the longest :func:`hold_point` waits
HOLD_MAX_S = 60.0


def hold_point(hold_dir: str, rank: int, step: int, layer: int) -> None:
    """A test hook that makes "inside a layer" deterministic without changing a byte: when
    ``HOLD/arm-S-L`` exists, the first worker to reach MoE layer L of the head's forward
    pass S (1 is the prompt's) renames it (atomically, so one worker takes it) to
    ``HOLD/held-R``, writes its pid to ``HOLD/inside-R`` and waits, inside that layer's call
    and before it computes, until ``held-R`` is removed (at most :data:`HOLD_MAX_S`).
    Without the arm file it returns at once."""
    d = os.fspath(hold_dir)
    held = os.path.join(d, f"held-{rank}")
    try:
        os.rename(os.path.join(d, f"arm-{step}-{layer}"), held)
    except OSError:
        return
    tmp = os.path.join(d, f".inside-{rank}")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(d, f"inside-{rank}"))
    deadline = time.monotonic() + HOLD_MAX_S
    while os.path.exists(held) and time.monotonic() < deadline:
        time.sleep(0.01)


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
        """Who this worker is: its rank, process, host and (under Ray) node id and address."""
        out: dict[str, Any] = {"rank": self.rank, "pid": os.getpid(),
                               "host": socket.gethostname(), "node": None, "address": None}
        ray = sys.modules.get("ray")  # imported in an actor; never imported here
        if ray is not None and ray.is_initialized():
            out["node"] = ray.get_runtime_context().get_node_id()
            out["address"] = ray.util.get_node_ip_address()
        return out

    def open(self, spec: WorkerSpec) -> dict[str, Any]:
        """Bind ``spec`` (closing whatever was bound); returns the names it resolved."""
        self.close()
        checked: dict[str, Any] = {}
        if spec.share is not None:  # this worker's share on this node, checked first
            where = share_root(spec.share_dir)
            if where is None:
                raise UsageError("no --expert-shares directory given and K3_EXPERT_SHARES is "
                                 "not set on this node")
            root = Path(where) / worker_name(spec.share.worker)
            v = verify_share(root, spec.share)
            checked = {"share": v.directory, "share_check": v.mode, "share_bytes": v.nbytes}
        else:
            root = Path(spec.model_dir)
            if not root.is_dir():
                raise UsageError(f"model directory {root} does not exist on this worker")
        cfg = load_config(Path(spec.config) if spec.config else root / "config.json")
        reg = get_registry()
        # the head's resolved plugins, opened the way every engine opens them
        kname, sname = spec.kernel, spec.storage
        kernels, _, index = open_checkpoint(root, Plugins(kernel=kname, storage=sname,
                                                          cache=spec.cache_policy), spec.threads)
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
                "slots": getattr(cache, "capacity", 0), **checked, **self.describe()}

    def digest(self) -> ShareDigest:
        assert self.index is not None and self.locator is not None and self.spec is not None
        return share_digest(self.index, self.locator, self.spec.owned)

    def compute(self, step: int, layer: int, experts: list[int], rows: list[np.ndarray],
                z: np.ndarray) -> list[np.ndarray]:
        """Outputs of ``experts`` of ``layer``: expert ``experts[i]`` over ``z[rows[i]]``
        (``step`` counts the head's forward passes: the cache's hit accounting)."""
        if self.source is None or self.cfg is None or self.kernels is None or self.spec is None:
            raise WorkerNotOpen(f"expert worker {self.rank} has no model bound (restarted?)")
        if self.spec.hold_dir is not None:
            hold_point(self.spec.hold_dir, self.rank, step, layer)
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
