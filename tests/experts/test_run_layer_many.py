"""``ExpertSource.run_layer_many``: every distinct expert of a visit exactly once, grouped
(one ``use_many`` call for a source that serves everything at once), and a source that
overrides only ``run_layer`` is still served correctly, one expert per call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from k3core.api.experts import ExpertSource, ExpertStats, ExpertWeights, InMemoryExperts


def _weights(layer: int, e: int) -> ExpertWeights:
    w = np.full((2, 2), layer * 100 + e, dtype=np.float32)
    return ExpertWeights(w, w, w)


def test_in_memory_source_serves_a_visit_in_one_call() -> None:
    src = InMemoryExperts(_weights)
    calls: list[list[int]] = []

    def use_many(group: list[tuple[int, ExpertWeights]]) -> None:
        calls.append([e for e, _ in group])
        for e, w in group:
            assert w.w1[0, 0] == 300 + e

    src.run_layer_many(3, [5, 1, 5, 7, 1], use_many)
    assert calls == [[5, 1, 7]], "distinct experts, first-request order, one call"


class OnlyRunLayer(ExpertSource):
    """A third-party source that knows only ``run_layer`` (in its own order)."""

    def __init__(self) -> None:
        self.stats = ExpertStats()

    def get_many(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        return [_weights(layer, int(e)) for e in experts]

    def run_layer(self, layer: int, requests: Sequence[int],
                  use: Callable[[int, ExpertWeights], None]) -> None:
        for e in sorted(set(int(r) for r in requests), reverse=True):
            use(e, _weights(layer, e))


def test_a_source_with_only_run_layer_is_served_through_it() -> None:
    calls: list[list[int]] = []
    OnlyRunLayer().run_layer_many(0, [2, 9, 2, 4], lambda g: calls.append([e for e, _ in g]))
    assert calls == [[9], [4], [2]]
