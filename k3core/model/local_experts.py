"""Routed experts computed in this process: the :class:`ExpertExecutor` a model has unless it
is handed another (``k3core.cluster``).

Per MoE layer :meth:`LocalExperts.run` schedules the layer's expert reads on its
:class:`~k3core.api.experts.ExpertSource` (``prefetch``: the cache walk, the reads submitted),
hands the source a later layer's guess behind them (router lookahead), runs ``beside`` (the
shared experts) meanwhile, then serves every expert whose bytes are in, each ready batch in
one ``situ_mlp_many`` call (:func:`serve_experts`), into the ``[row, slot]`` places of the
outputs. From :data:`SIDE_SCHEDULE_TOKENS` tokens in a pass the scheduling runs on a side
thread beside ``beside``, and is waited for before an expert is served; the reads, their
order and every sum are the same either way.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import numpy as np

from k3core.api.daemon_executor import DaemonExecutor
from k3core.api.experts import ExpertExecutor, ExpertSource, ExpertWeights
from k3core.api.kernels import KernelBackend

#: From this many tokens in a pass, a MoE layer schedules its routed experts' reads (the cache
#: walk, the reads submitted, the next layer's guessed reads) on a side thread while the
#: calling thread runs the shared experts, and waits for the scheduling before it serves an
#: expert. The walk is Python and the shared experts release the GIL, so the two overlap; in
#: a fresh engine's first 128-id medium prefill the walk is every expert a miss, about 4 ms a
#: layer that the kernels' helper thread otherwise spent idle. The reads, their order and
#: every sum are the same either way. A one-token step's walk is a few microseconds, less
#: than the hand-off, so it stays on the calling thread.
SIDE_SCHEDULE_TOKENS = 16


class LocalExperts(ExpertExecutor):
    """Routed experts of ``source`` computed with ``kernels`` here (see the module doc)."""

    takes_guesses = True

    def __init__(self, source: ExpertSource, kernels: KernelBackend, situ_b1: float,
                 situ_b2: float):
        self.source = source
        self.k = kernels
        self.situ = (situ_b1, situ_b2)
        self._side: DaemonExecutor | None = None  # see SIDE_SCHEDULE_TOKENS

    def begin_step(self) -> None:
        self.source.begin_step()

    def lookahead(self, layer: int, experts: Sequence[int]) -> None:
        self.source.lookahead(layer, experts)

    def run(self, layer: int, idx: np.ndarray, z: np.ndarray,
            beside: Callable[[], np.ndarray] | None = None,
            guess: tuple[int, list[int]] | None = None,
            ) -> tuple[np.ndarray, np.ndarray | None]:
        requests = [int(e) for e in idx.reshape(-1)]
        T = idx.shape[0]

        def schedule() -> None:
            self.source.prefetch(layer, requests)
            if guess is not None:  # queued behind this layer's own reads
                self.source.lookahead(*guess)

        side: Future[None] | None = None
        if beside is not None and T >= SIDE_SCHEDULE_TOKENS:
            side = self._side_thread().submit(schedule)
        else:
            schedule()
        extra = None
        try:
            if beside is not None:
                extra = beside()
        except BaseException:
            if side is not None:  # already failing: let the scheduling end, keep this error
                concurrent.futures.wait([side])
            raise
        if side is not None:  # the reads are scheduled before anything else touches the cache
            side.result()
        outs = np.empty((T, idx.shape[1], z.shape[1]), dtype=np.float32)
        where = _expert_rows(idx)

        def put(e: int, y: np.ndarray) -> None:
            rows, slots = where[e]
            if len(rows) == 1:  # one place (every expert of a decode row): no fancy index
                outs[rows[0], slots[0]] = y[0]
            else:
                outs[rows, slots] = y

        serve_experts(self.source, self.k, self.situ, layer, requests,
                      {e: rows for e, (rows, _) in where.items()}, z, put)
        return outs, extra

    def _side_thread(self) -> DaemonExecutor:
        """The thread that schedules a MoE layer's expert reads beside its shared experts
        (started on first use, stopped by :meth:`close` or when this executor is collected)."""
        if self._side is None:
            self._side = DaemonExecutor("k3-moe-schedule")
            weakref.finalize(self, self._side.shutdown, False)
        return self._side

    def close(self) -> None:
        """Stop the side thread, if one was started (a later pass starts another); the
        source is closed by its owner."""
        side, self._side = self._side, None
        if side is not None:
            side.shutdown(wait=True)


def serve_experts(source: ExpertSource, k: KernelBackend, situ: tuple[float, float],
                  layer: int, requests: Sequence[int], rows: Mapping[int, np.ndarray],
                  z: np.ndarray, put: Callable[[int, np.ndarray], None]) -> None:
    """Every distinct expert of ``requests`` (``layer``'s routed requests, in order) over its
    ``rows`` of ``z``: each batch the source has ready in one ``situ_mlp_many`` call (each
    expert's ``situ_mlp`` bits), ``put(expert, output)`` once an expert. Used here and by
    a cluster's worker (``k3core/cluster/worker.py``)."""

    def use_many(group: list[tuple[int, ExpertWeights]]) -> None:
        ats = [rows[e] for e, _ in group]
        ys = k.situ_mlp_many([(w.w1, w.w3, w.w2) for _, w in group],
                             [z if len(r) == z.shape[0] == 1 else z[r] for r in ats], *situ)
        for (e, _), y in zip(group, ys, strict=True):
            put(e, y)

    source.run_layer_many(layer, requests, use_many)


def _expert_rows(idx: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each routed expert's ``(rows, slots)`` in the router's ``[T, topk]`` ids, rows in
    increasing order (a stable sort of the flat ids keeps each expert's positions in order)."""
    flat = idx.reshape(-1)
    if not flat.size:
        return {}
    ids1 = flat.tolist()
    if idx.shape[0] == 1 and len(set(ids1)) == len(ids1):  # a decode row: each id once
        row = np.zeros(1, dtype=np.int64)
        return {e: (row, np.array([j], dtype=np.int64))
                for e, j in sorted(zip(ids1, range(len(ids1)), strict=True))}
    order = np.argsort(flat, kind="stable")
    ids = flat[order]
    cut = (np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist()
    rows, slots = np.divmod(order, idx.shape[1])
    return {int(ids[a]): (rows[a:b], slots[a:b])
            for a, b in zip([0, *cut], [*cut, flat.size], strict=True)}
