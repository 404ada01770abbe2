"""A worker lost in the middle of a run: restarted, opened again, its layer's call sent again.

The computation is deterministic: a worker's outputs are a function of its share's bytes
and the latent rows the head sends, so a call sent again to a restarted worker returns
the same bits, and the tokens and logits of a run that lost a worker equal an undisturbed
run's. What it takes:

* the actors are created with Ray's ``max_restarts`` (:func:`max_restarts`: every time
  while retries are allowed, never with ``--worker-retries 0``), and ``max_task_retries``
  0: the head decides what is sent again;
* a call fails as *lost* (:func:`is_lost`) when Ray says the actor died or is restarting
  (``RayActorError``, killed inside the layer), or when it reached a restarted worker that
  holds nothing yet (:class:`~k3core.cluster.worker.WorkerNotOpen`, killed between
  tokens);
* the head then waits for the worker to be back (bounded), opens it again with the same
  spec and checks its share again (:meth:`ClusterExperts._recover`), and sends the same
  call; at most :attr:`RetryPolicy.retries` times per call. When they run out, or the
  worker does not come back, the run ends with exit 4 naming the worker, its node and the
  layer (:class:`~k3core.api.errors.ExpertDropError`), as before.

A worker that stops answering (the layer timeout) is not retried: it may still be
computing, and a second call would race it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3core.api.errors import UsageError
from k3core.cluster.worker import WorkerNotOpen

#: ``--worker-retries``: how many times one layer's call to one worker is sent again
DEFAULT_RETRIES = 2
MAX_RETRIES = 100


def check_retries(retries: int) -> int:
    if not 0 <= retries <= MAX_RETRIES:
        raise UsageError(f"--worker-retries must be in 0..{MAX_RETRIES}, got {retries}")
    return retries


def max_restarts(retries: int) -> int:
    """Ray's ``max_restarts`` for the workers: -1 (every time) while retries are allowed;
    each call's retries bound what a worker that keeps dying can cost."""
    return -1 if retries > 0 else 0


def is_lost(ray: Any, exc: BaseException) -> bool:
    """Whether ``exc`` (from ``ray.get`` of a worker's call) means the worker died or was
    restarted, so the call may be sent again once it is open."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return True
    if isinstance(exc, ray.exceptions.RayTaskError):
        return isinstance(getattr(exc, "cause", None), WorkerNotOpen)
    return False


@dataclass
class RetryPolicy:
    """How often a layer's call is sent again, and what happened (for the report)."""

    retries: int = DEFAULT_RETRIES
    #: ``(worker, MoE layer, what)`` of every retry made
    events: list[tuple[int, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_retries(self.retries)

    @property
    def restarts(self) -> int:
        return max_restarts(self.retries)

    def to_json(self) -> dict[str, Any]:
        return {"worker_retries": self.retries, "retried": len(self.events),
                "retries_made": [{"worker": w, "layer": L, "why": why}
                                 for w, L, why in self.events]}
