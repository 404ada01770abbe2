"""Where routed experts come from: the :class:`ExpertSource` interface.

The MoE block asks for one layer's selected experts in one batch (``get_many``) and gets
back their weights exactly as stored (MXFP4 packed bytes and scales, or dense float32 for
the oracle). The in-memory source here serves a model whose experts are all resident; the
expert cache (``k3core.experts.cache``) serves them from disk through a policy plugin.

An :class:`ExpertExecutor` computes a layer's routed-expert outputs from the latent rows:
here from a source (``k3core.model.local_experts``), or elsewhere (other processes or
machines, ``k3core.cluster``), so the forward pass only sums what comes back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.api.kernels import Mxfp4

Matrix = Mxfp4 | np.ndarray


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: ``w1`` gate and ``w3`` up ``[inter, latent]``, ``w2`` down."""

    w1: Matrix
    w3: Matrix
    w2: Matrix


@dataclass
class ExpertStats:
    """Whole-run counters a source reports (see the run report)."""

    requests: int = 0
    hits: int = 0  # resident before the step began
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    exposed_wait_seconds: float = 0.0
    drops: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class ExpertSource(ABC):
    """Serves routed experts by ``(layer, expert)``."""

    stats: ExpertStats

    @abstractmethod
    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        """Return the weights of ``experts`` of ``layer``, in the order asked.

        Raises ``K3Error`` when an expert cannot be served; never returns partial bytes.
        """

    def prefetch(self, layer: int, requests: Sequence[int]) -> None:  # noqa: B027
        """Start reading the experts of ``requests`` without waiting (optional)."""

    def run_layer(
        self, layer: int, requests: Sequence[int], use: Callable[[int, ExpertWeights], None]
    ) -> None:
        """Serve one MoE layer visit: ``requests`` is every routed request of the visit in
        order (duplicates included); ``use(expert, weights)`` is called once per distinct
        expert while its weights are valid. A source may call ``use`` in any order and in
        several batches (results never depend on it: each call fills independent outputs).
        """
        distinct = list(dict.fromkeys(int(e) for e in requests))
        for e, w in zip(distinct, self.get_many(layer, distinct), strict=True):
            use(e, w)

    def lookahead(self, layer: int, guess: Sequence[int]) -> None:  # noqa: B027
        """A guess of ``layer``'s experts (not a request): a source may start reading them
        at low priority (optional; nothing may depend on it)."""

    def run_layer_many(
        self, layer: int, requests: Sequence[int],
        use_many: Callable[[list[tuple[int, ExpertWeights]]], None],
    ) -> None:
        """:meth:`run_layer` with every expert that is ready at once: ``use_many`` gets a
        list of ``(expert, weights)`` (each distinct expert once over the visit, its weights
        valid during the call), in one or more batches (the expert cache: each batch of the
        visit once all of its reads completed). Results never depend on the grouping. A source
        that overrides only :meth:`run_layer` is served through it, one expert per call.
        """
        if type(self).run_layer is not ExpertSource.run_layer:
            self.run_layer(layer, requests, lambda e, w: use_many([(e, w)]))
            return
        distinct = list(dict.fromkeys(int(e) for e in requests))
        use_many(list(zip(distinct, self.get_many(layer, distinct), strict=True)))

    def begin_step(self) -> None:  # noqa: B027
        """Called at the start of every generation step."""

    def close(self) -> None:  # noqa: B027
        """Stop any threads and release buffers."""


class InMemoryExperts(ExpertSource):
    """Every expert resident, built on first use by a loader callable."""

    def __init__(self, loader: Callable[[int, int], ExpertWeights]):
        self._loader = loader
        self._experts: dict[tuple[int, int], ExpertWeights] = {}
        self.stats = ExpertStats()

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        out = []
        for e in experts:
            key = (layer, int(e))
            self.stats.requests += 1
            w = self._experts.get(key)
            if w is None:
                w = self._loader(layer, int(e))
                self._experts[key] = w
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            out.append(w)
        return out


class ExpertExecutor(ABC):
    """Computes one MoE layer's routed-expert outputs: in this process from an
    :class:`ExpertSource` (``k3core.model.local_experts``), or somewhere else
    (``k3core.cluster``). The forward pass calls :meth:`run` once a MoE layer.

    The contract that keeps the logits byte-identical wherever they are computed: for every
    distinct expert ``e`` of ``idx``, its output rows are the kernel backend's
    ``situ_mlp(w1, w3, w2, z[rows])`` where ``rows`` are the rows routed to ``e`` in
    ascending order (exactly what :meth:`ExpertSource.run_layer`'s ``use`` computes), with
    the same kernel backend.
    """

    #: the router lookahead's guesses reach a source that may read them (the model computes
    #: a guess only for an executor that takes them)
    takes_guesses: bool = False

    @abstractmethod
    def run(self, layer: int, idx: np.ndarray, z: np.ndarray,
            beside: Callable[[], np.ndarray] | None = None,
            guess: tuple[int, list[int]] | None = None,
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """The outputs of ``layer``'s routed experts (``idx`` ``[T, topk]`` expert ids, ``z``
        ``[T, latent]`` float32): ``outs`` ``[T, topk, latent]`` float32 (``outs[t, j]`` is
        expert ``idx[t, j]`` applied to ``z[t]``), and what ``beside`` returned: the work the
        caller does meanwhile (the shared experts), run on the calling thread while the
        experts' reads or calls are under way. ``guess`` (a later layer and its guessed
        experts, router lookahead) is handed on behind this layer's own reads. Raises
        ``K3Error`` when an expert cannot be computed (never partial outputs)."""

    def lookahead(self, layer: int, experts: Sequence[int]) -> None:  # noqa: B027
        """A guess of a later ``layer``'s experts, handed on now (optional; nothing may
        depend on it)."""

    def begin_step(self) -> None:  # noqa: B027
        """Called at the start of every forward call."""

    def start(self, engine: Any, line: Callable[[str], None]) -> None:  # noqa: B027
        """Called once the engine is open, before the first token: bind the workers and
        hand ``engine.model`` this executor (``line`` prints a report line)."""

    def report(self, line: Callable[[str], None]) -> dict[str, Any]:
        """After the run: report lines, and the ``--out`` record's ``cluster`` entry."""
        return {}

    def close(self) -> None:  # noqa: B027
        """Stop threads; release workers and connections."""
