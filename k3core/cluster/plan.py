"""Which worker owns which routed expert: planned by bytes, per MoE layer.

Every MoE layer's experts are cut, in id order, into N contiguous runs of about equal bytes
(each expert's size from the checkpoint headers), and the runs are rotated over the workers
layer by layer, so a token's experts spread over every worker and no worker collects every
layer's remainder. The plan is fixed for the run, printed and recorded in ``--out``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from k3core.api.errors import CheckpointError, UsageError
from k3core.api.units import human
from k3core.experts.locator import ExpertLocator
from k3core.model.config import ModelConfig


@dataclass
class SharePlan:
    """``owner[layer][expert] -> worker``, and what each worker holds."""

    n_workers: int
    owner: dict[int, list[int]]
    bytes_per_worker: list[int] = field(default_factory=list)
    experts_per_worker: list[int] = field(default_factory=list)

    def owned(self, worker: int) -> dict[int, list[int]]:
        """``layer -> experts`` owned by ``worker``, ascending."""
        return {L: [e for e, w in enumerate(ws) if w == worker] for L, ws in self.owner.items()}

    def lines(self) -> list[str]:
        total = sum(self.bytes_per_worker)
        out = [f"expert plan : {self.n_workers} worker(s), {sum(self.experts_per_worker)} routed "
               f"experts over {len(self.owner)} MoE layers, {human(total)}, split by bytes"]
        for w, (n, b) in enumerate(zip(self.experts_per_worker, self.bytes_per_worker, strict=True)):
            share = 100.0 * b / total if total else 0.0
            out.append(f"  worker {w}: {n} experts, {human(b)} ({share:.1f}%)")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "workers": self.n_workers,
            "bytes_per_worker": self.bytes_per_worker,
            "experts_per_worker": self.experts_per_worker,
            "ranges": {str(L): _ranges(ws, self.n_workers) for L, ws in self.owner.items()},
        }

    def fingerprint(self, model: str) -> str:
        """SHA-256 of the model's fingerprint, the worker count and every expert's owner:
        two shares agree on their plan exactly when these agree."""
        body = json.dumps({"model": model, "workers": self.n_workers,
                           "owner": {str(L): ws for L, ws in sorted(self.owner.items())}},
                          sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    @classmethod
    def from_json(cls, d: Any, where: str) -> SharePlan:
        """The plan :meth:`to_json` wrote (``where`` names the file in a refusal, exit 1):
        every layer's runs must cover its experts once."""
        try:
            n = int(d["workers"])
            ranges = {int(L): [(int(a), int(b)) for a, b in rs] for L, rs in d["ranges"].items()}
            nbytes = [int(x) for x in d["bytes_per_worker"]]
            count = [int(x) for x in d["experts_per_worker"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: the expert plan is malformed ({exc!r})") from None
        owner: dict[int, list[int]] = {}
        for L, rs in sorted(ranges.items()):
            total = max((b for _, b in rs), default=0)
            ws = [-1] * total
            for w, (a, b) in enumerate(rs):
                for e in range(a, b):
                    if ws[e] != -1:
                        raise CheckpointError(f"{where}: expert {L}/{e} has two owners")
                    ws[e] = w
            if len(rs) != n or not ws or -1 in ws:
                raise CheckpointError(f"{where}: layer {L}'s runs do not cover its experts once")
            owner[L] = ws
        if len(nbytes) != n or len(count) != n:
            raise CheckpointError(f"{where}: the expert plan lists {len(nbytes)} shares for {n} "
                                  "workers")
        return cls(n, owner, nbytes, count)


def _ranges(ws: list[int], n: int) -> list[list[int]]:
    """Per worker ``[first, last + 1]`` of its run in one layer."""
    out = []
    for w in range(n):
        ids = [e for e, o in enumerate(ws) if o == w]
        out.append([ids[0], ids[-1] + 1] if ids else [0, 0])
    return out


def plan_shares(cfg: ModelConfig, locator: ExpertLocator, n_layers: int, n_workers: int) -> SharePlan:
    """Split every MoE layer of the first ``n_layers`` over ``n_workers`` by bytes."""
    if n_workers < 1:
        raise UsageError(f"--expert-workers must be >= 1, got {n_workers}")
    if n_workers > cfg.n_experts:
        raise UsageError(f"--expert-workers {n_workers}: the model has only {cfg.n_experts} "
                         "routed experts a layer; each worker must own at least one")
    owner: dict[int, list[int]] = {}
    nbytes = [0] * n_workers
    count = [0] * n_workers
    moe = [L for L in range(n_layers) if not cfg.is_dense(L)]
    for i, L in enumerate(moe):
        sizes = [locator.ref(L, e).nbytes for e in range(cfg.n_experts)]
        total = sum(sizes)
        ws: list[int] = []
        before = 0
        for s in sizes:
            # the run an expert falls in: where the middle of its bytes lies in the layer
            # (equal sizes and at least N experts: no run is empty)
            run = min(n_workers - 1, (2 * before + s) * n_workers // (2 * total)) if total else 0
            w = (run + i) % n_workers
            ws.append(w)
            nbytes[w] += s
            count[w] += 1
            before += s
        owner[L] = ws
    return SharePlan(n_workers, owner, nbytes, count)

