"""The head's side: routed experts computed by the workers of a :class:`WorkerPool`.

:class:`ClusterExperts` is the :class:`ExpertExecutor` the forward pass is handed. ``start``
(once the engine is open, before the first token) plans the shares by bytes, binds every
worker to its share with the head's kernel backend, storage backend and cache policy, and
refuses a worker whose share differs from the head's files. A head written by ``k3
shard-experts`` holds no routed expert: its plan is the one the shares were written under
(``head/expert-shares.json``), and each worker checks its own share against the head's
record instead (:mod:`k3core.cluster.shares`). ``submit`` then sends, per MoE layer, every
worker its experts' latent rows in one call each, all at once (the head computes its
shared experts meanwhile): however many rows the pass carries (a prompt, a batch of
drafts), one call per worker per layer. The callable it returns gathers the outputs into
their ``[row, slot]`` places, so the head's weighted sum runs in the original order on the
same bytes as on one node. Every wait is bounded. A worker that dies is restarted, opened
again and sent the same call (:mod:`k3core.cluster.retry`, ``--worker-retries``); a worker
that does not come back, dies past the retries or does not answer stops the run with exit
4, naming the worker, its node and the layer; no token is produced from a partial layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import CheckpointError, ExpertDropError, K3Error, UsageError
from k3core.api.experts import ExpertExecutor, ExpertWeights, InMemoryExperts
from k3core.cluster.plan import SharePlan, plan_shares
from k3core.cluster.pool import WorkerPool, import_ray, start_pool
from k3core.cluster.retry import DEFAULT_RETRIES, RetryPolicy, is_lost
from k3core.cluster.share import ShareDigest, check_share, share_digest
from k3core.cluster.shares import HeadManifest, is_head, read_head_manifest
from k3core.cluster.traffic import MAX_BYTES_PER_TOKEN, real_traffic, traffic
from k3core.cluster.worker import WorkerSpec
from k3core.experts.locator import ExpertLocator
from k3core.model.config import ModelConfig

#: the longest one layer's calls may take before the run stops (exit 4)
LAYER_TIMEOUT_S = 300.0
#: binding a worker (indexing its checkpoint) and checksumming its share
OPEN_TIMEOUT_S = 900.0

Line = Callable[[str], None]


def _served_by_workers(layer: int, expert: int) -> ExpertWeights:
    raise K3Error(f"routed expert {layer}/{expert} was asked of the head; the workers serve them")


class ClusterExperts(ExpertExecutor):
    """Routed experts on Ray workers (see the module docstring)."""

    def __init__(self, workers: int | None = None, address: str | None = None, *,
                 cache_gb: float | None = None, pool: WorkerPool | None = None,
                 model_dirs: list[str] | None = None, shares: str | None = None,
                 retries: int = DEFAULT_RETRIES, hold_dir: str | None = None,
                 layer_timeout_s: float = LAYER_TIMEOUT_S, open_timeout_s: float = OPEN_TIMEOUT_S):
        import_ray()  # say how to get Ray before anything else runs (exit 2)
        if workers is not None and workers < 1:
            raise UsageError(f"--expert-workers must be >= 1, got {workers}")
        self.workers, self.address, self.cache_gb = workers, address, cache_gb
        self.layer_timeout_s, self.open_timeout_s = layer_timeout_s, open_timeout_s
        self._given_pool = pool
        #: each worker's model directory (default: the head's path, on its own machine)
        self.model_dirs = model_dirs
        #: the directory holding ``worker-i`` on every node (``--expert-shares``), for a head
        #: written by ``k3 shard-experts``
        self.shares = shares
        self.retry = RetryPolicy(retries)
        self.hold_dir = hold_dir  # a test hook (worker.hold_point); None in every real run
        self.specs: list[WorkerSpec] = []
        self._ours: list[ShareDigest] | None = None  # the head's digests of whole-checkpoint shares
        self._grace_until = 0.0  # a layer's deadline after a worker was recovered in it
        self.pool: WorkerPool | None = None
        self.plan: SharePlan | None = None
        self.bound: list[dict[str, Any]] = []
        self.sent = self.received = self.round_trips = self.calls = 0
        self.steps = 0
        self._last_layer = 1 << 30
        self.actors: list[Any] = []
        self._plan_json: dict[str, Any] = {}

    # ---- before the first token --------------------------------------------------------------
    def start(self, engine: Any, line: Line) -> None:
        """Plan, bind and check every worker for ``engine`` (an opened ``k3core.run`` engine)."""
        cfg, index, n_layers = engine.cfg, engine.index, engine.model.n_layers
        head = self._head_manifest(Path(index.model_dir))
        locator = ExpertLocator(cfg, index) if head is None else None
        pool = self._given_pool
        n = self.workers or (head.workers if head is not None else None)
        n = n or (len(pool.actors) if pool is not None else None)
        if head is not None:
            _check_head_plan(head, cfg, n, str(index.model_dir))
        elif n is not None and locator is not None:
            plan_shares(cfg, locator, n_layers, n)  # a refusal before any actor starts
        if pool is None:
            pool = start_pool(n, self.address, restarts=self.retry.restarts)
        self.pool = pool
        n = n or len(pool.actors)
        if n > len(pool.actors):
            raise K3Error(f"{n} expert workers asked for, the pool has {len(pool.actors)}")
        if head is not None:
            plan = head.plan
        else:
            assert locator is not None
            plan = plan_shares(cfg, locator, n_layers, n)
        self.plan = plan
        for text in plan.lines():
            line(text)
        for text in pool.lines()[:n]:
            line(text)
        names = engine.names
        dirs = self.model_dirs or [str(index.model_dir)] * n
        self.specs = [WorkerSpec(dirs[w], None, n_layers, names["kernel"], names["storage"],
                                 names["cache"] if names["cache"] != "none" else "auto",
                                 self.cache_gb, engine.kernels.threads, plan.owned(w),
                                 share=head.expect(w) if head is not None else None,
                                 share_dir=self.shares, hold_dir=self.hold_dir)
                      for w in range(n)]
        actors = pool.actors[:n]
        self.bound = self._get([a.open.remote(s) for a, s in zip(actors, self.specs, strict=True)],
                               self.open_timeout_s, "binding its share")
        if head is None:  # a whole checkpoint on every node: its share's bytes against ours
            assert locator is not None
            refs = [a.digest.remote() for a in actors]  # the workers hash while the head does
            self._ours = [share_digest(index, locator, plan.owned(w)) for w in range(n)]
            theirs = self._get(refs, self.open_timeout_s, "checksumming its share")
            for w in range(n):
                check_share(pool.name(w), self._ours[w], theirs[w])
            checked = [f"share checked ({t.mode} checksum of {t.nbytes} B)" for t in theirs]
        else:
            checked = [f"share {b['share']} checked ({b['share_check']} checksum of "
                       f"{b['share_bytes']} B)" for b in self.bound]
        for w, b in enumerate(self.bound):
            line(f"  {pool.name(w)}: kernel {b['kernel']}, storage {b['storage']}, cache {b['cache']} "
                 f"({b['slots']} slots); {checked[w]}")
        here = traffic(cfg, n, n_layers)
        line(here.line("this model's"))
        real = real_traffic(n)
        line(real.line("real"))
        if real.bytes_per_token > MAX_BYTES_PER_TOKEN:
            line(f"NOTE: above {MAX_BYTES_PER_TOKEN / 1e6:.0f} MB a token at the real shape; "
                 "fewer workers move less")
        self._plan_json = {"plan": plan.to_json(), "traffic": here.to_json(),
                           "traffic_real_shape": real.to_json(),
                           "placement": pool.lines()[:n],
                           "shares": self.shares if head is not None else None}
        self.actors = actors
        # the workers serve every routed expert: an engine opened for remote experts has no
        # cache; one a caller opened with its own is released unused
        engine.experts.close()
        engine.experts = InMemoryExperts(_served_by_workers)
        engine.model.hand_experts(self)

    def _head_manifest(self, model_dir: Path) -> HeadManifest | None:
        """The head's manifest when MODEL_DIR is a head written by ``k3 shard-experts``."""
        if not is_head(model_dir):
            if self.shares is not None:
                raise UsageError(f"--expert-shares needs MODEL_DIR to be the head/ written by k3 "
                                 f"shard-experts; {model_dir} holds a whole checkpoint (drop "
                                 "--expert-shares to have every worker read it)")
            return None
        if self.shares is None:
            raise UsageError(f"{model_dir} is the head of a sharded checkpoint (k3 shard-experts): "
                             "it holds no routed expert; give --expert-shares DIR, the directory "
                             "holding worker-0 ... on the worker nodes")
        return read_head_manifest(model_dir)

    # ---- one MoE layer -----------------------------------------------------------------------
    def run(self, layer: int, idx: np.ndarray, z: np.ndarray,
            beside: Callable[[], np.ndarray] | None = None,
            guess: tuple[int, list[int]] | None = None,
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """Every worker's calls sent at once, ``beside`` (the head's shared experts) run
        meanwhile, then the outputs gathered; the workers take no guesses."""
        wait = self.submit(layer, idx, z)
        extra = beside() if beside is not None else None
        return wait(), extra

    def submit(self, layer: int, idx: np.ndarray, z: np.ndarray) -> Callable[[], np.ndarray]:
        """Send ``layer``'s work without waiting; the callable returned waits (each call
        bounded) and places every expert's output rows at their ``[row, slot]``."""
        assert self.plan is not None and self.pool is not None
        if layer <= self._last_layer:  # layers run in ascending order: a new forward pass
            self.steps += 1
        self._last_layer = layer
        owner = self.plan.owner[layer]
        work: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for e in dict.fromkeys(int(x) for x in idx.reshape(-1)):
            rows, slots = np.nonzero(idx == e)
            work.setdefault(owner[e], []).append((e, rows, slots))
        calls = []
        for w, items in sorted(work.items()):
            urows = np.unique(np.concatenate([r for _, r, _ in items]))
            zu = np.ascontiguousarray(z[urows])
            local = [np.searchsorted(urows, r) for _, r, _ in items]
            experts = [e for e, _, _ in items]
            args = (self.steps, layer, experts, local, zu)  # kept: sent again to a restarted worker
            ref = self.actors[w].compute.remote(*args)
            self.sent += zu.nbytes + sum(a.nbytes for a in local) + 8 * len(experts)
            calls.append((w, (ref, args), items))
        self.round_trips += 1
        self.calls += len(calls)
        shape = (idx.shape[0], idx.shape[1], z.shape[1])

        def wait() -> np.ndarray:
            outs = np.empty(shape, dtype=np.float32)
            deadline = time.monotonic() + self.layer_timeout_s
            for w, call, items in calls:
                # a recovery elsewhere in this layer gives the others its time back
                res = self._one(w, call, layer, max(deadline, self._grace_until))
                if len(res) != len(items):
                    raise self._dropped(w, layer, f"returned {len(res)} outputs for {len(items)} experts")
                for (e, rows, slots), o in zip(items, res, strict=True):
                    if o.dtype != np.float32 or o.shape != (len(rows), shape[2]):
                        raise self._dropped(w, layer, f"expert {e} came back as {o.dtype} {o.shape}")
                    outs[rows, slots] = o
                    self.received += o.nbytes
            return outs

        return wait

    def _one(self, w: int, call: tuple[Any, tuple[Any, ...]], layer: int,
             deadline: float) -> list[np.ndarray]:
        """Worker ``w``'s outputs for ``layer``; a lost worker is recovered and sent the same
        call again, at most ``retries`` times (:mod:`k3core.cluster.retry`)."""
        ray = self.pool.ray if self.pool is not None else import_ray()
        ref, args = call
        tries = 0
        while True:
            try:
                return list(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                raise self._dropped(w, layer, f"did not answer within {self.layer_timeout_s:g} s") from None
            except ray.exceptions.RayError as exc:
                if not is_lost(ray, exc):
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, K3Error):
                        raise ExpertDropError(f"{self._name(w)}, MoE layer {layer}: {cause.message}") from None
                    raise self._dropped(w, layer, f"failed: {str(exc).splitlines()[0]}") from None
                if tries >= self.retry.retries:
                    more = f" (after {tries} retries)" if tries else ""
                    raise self._dropped(w, layer, f"died{more}") from None
            tries += 1
            self._recover(w, layer)
            self.retry.events.append((w, layer, "died" if tries == 1 else "died again"))
            ref = self.actors[w].compute.remote(*args)
            deadline = self._grace_until = time.monotonic() + self.layer_timeout_s

    def _recover(self, w: int, layer: int) -> None:
        """Wait for Ray to restart worker ``w``, open it again with its spec and check its
        share again; a worker that does not come back ends the run (exit 4)."""
        assert self.pool is not None
        ray, was = self.pool.ray, self._name(w)
        try:
            self.pool.describe(w, self.open_timeout_s)  # answers once restarted: new pid
            bound = ray.get(self.actors[w].open.remote(self.specs[w]), timeout=self.open_timeout_s)
            if self._ours is not None:
                theirs = ray.get(self.actors[w].digest.remote(), timeout=self.open_timeout_s)
                check_share(self._name(w), self._ours[w], theirs)
        except ray.exceptions.GetTimeoutError:
            raise self._dropped(w, layer, f"died and was not back within {self.open_timeout_s:g} s",
                                who=was) from None
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            why = cause.message if isinstance(cause, K3Error) else str(exc).splitlines()[0]
            raise self._dropped(w, layer, f"died and could not be opened again ({why})",
                                who=was) from None
        except ray.exceptions.RayError as exc:
            raise self._dropped(w, layer, "died and was not restarted "
                                f"({str(exc).splitlines()[0]})", who=was) from None
        self.bound[w] = bound

    def _name(self, w: int) -> str:
        return self.pool.name(w) if self.pool is not None else f"expert worker {w}"

    def _dropped(self, w: int, layer: int, what: str, who: str | None = None) -> ExpertDropError:
        return ExpertDropError(f"{who or self._name(w)} {what} during MoE layer {layer}; its "
                               "experts' outputs are missing, so no token is produced (the run "
                               "is invalid)")

    def _get(self, refs: list[Any], timeout: float, doing: str) -> list[Any]:
        ray = self.pool.ray if self.pool is not None else import_ray()
        out = []
        deadline = time.monotonic() + timeout
        for w, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                raise K3Error(f"{self._name(w)} took longer than {timeout:g} s {doing}") from None
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, K3Error):
                    raise type(cause)(f"{self._name(w)}: {cause.message}",
                                      exit_code=cause.exit_code, hint=cause.hint) from None
                raise K3Error(f"{self._name(w)} failed {doing}: {str(exc).splitlines()[0]}") from None
            except ray.exceptions.RayActorError:
                raise K3Error(f"{self._name(w)} died {doing}") from None
        return out

    # ---- after the run -----------------------------------------------------------------------
    def report(self, line: Line) -> dict[str, Any]:
        """The run's traffic (lines and the ``--out`` record's ``cluster`` entry)."""
        steps = max(1, self.steps)
        stats: list[dict[str, Any]] = []
        try:
            stats = self._get([a.stats.remote() for a in self.actors], 30.0, "reporting")
        except K3Error as exc:
            line(f"NOTE: worker statistics unavailable ({exc.message})")
        line(f"cluster: {len(self.actors)} worker(s); per token {self.sent / steps / 1e6:.4f} MB sent, "
             f"{self.received / steps / 1e6:.4f} MB received, {self.round_trips / steps:.1f} round "
             f"trips ({self.calls / steps:.1f} actor calls) over {self.steps} forward passes")
        for w, layer, why in self.retry.events:
            line(f"  retried: {self._name(w)} {why} during MoE layer {layer}; restarted, opened "
                 "again and sent the same call")
        for w, s in enumerate(stats):
            line(f"  {self._name(w)}: {s.get('requests', 0)} requests, {s.get('hits', 0)} hits, "
                 f"{s.get('misses', 0)} misses, {s.get('bytes_read', 0)} B read")
        return {**self._plan_json, "workers": self.bound, "worker_stats": stats,
                "forward_passes": self.steps, "bytes_sent": self.sent,
                "bytes_received": self.received, "round_trips": self.round_trips,
                "actor_calls": self.calls, "bytes_sent_per_token": self.sent / steps,
                "bytes_received_per_token": self.received / steps,
                "round_trips_per_token": self.round_trips / steps, **self.retry.to_json()}

    def close(self) -> None:
        if self.pool is not None and self._given_pool is None:
            self.pool.close()


def _check_head_plan(head: HeadManifest, cfg: ModelConfig, n: int | None, where: str) -> None:
    """The head's plan against the run: its worker count, and the config's MoE layers and
    experts (a head whose manifest does not fit its config is damaged: exit 1)."""
    if n is not None and n != head.workers:
        raise UsageError(f"{where} was sharded for {head.workers} expert workers; "
                         f"--expert-workers {n} does not match",
                         hint=f"run with --expert-workers {head.workers}, or shard the model "
                              f"again with k3 shard-experts --workers {n}")
    moe = {L for L in range(cfg.n_layers) if not cfg.is_dense(L)}
    if set(head.plan.owner) != moe or any(len(ws) != cfg.n_experts
                                          for ws in head.plan.owner.values()):
        raise CheckpointError(f"{where}: the expert plan in its manifest does not fit its "
                              "config (other MoE layers or expert counts); shard the model again")
