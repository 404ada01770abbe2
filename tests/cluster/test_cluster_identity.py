"""Expert-parallel on Ray gives the ids and logit bytes of one node, for N = 1, 2, 3 workers,
on every kernel backend, full recompute and incremental, resident and streamed trunk."""

from __future__ import annotations

import numpy as np
import pytest
from thin import thinned

from k3core.plugins.registry import get_registry
from k3core.run.engine import open_engine
from k3core.run.generate import RunResult, generate
from k3core.run.request import EngineRequest

PROMPT = [3, 7, 11, 5]
GEN = 3
KERNELS = sorted(get_registry().names("kernel"))
_reference: dict[tuple[str, bool, bool], RunResult] = {}


def _opts(tiny, trunk, backend: str, streamed: bool) -> EngineRequest:
    return EngineRequest(model_dir=tiny, backend=backend, storage="mmap",
                         trunk=trunk if streamed else None)


def _available(backend: str) -> None:
    avail = get_registry().probe("kernel", backend)
    if not avail.ok:
        pytest.skip(f"kernel backend {backend} unavailable: {avail.reason}")


def _one_node(tiny, trunk, backend: str, incremental: bool, streamed: bool) -> RunResult:
    key = (backend, incremental, streamed)
    if key not in _reference:
        eng = open_engine(_opts(tiny, trunk, backend, streamed))
        try:
            _reference[key] = generate(eng.model, PROMPT, GEN, incremental=incremental, keep_logits=True)
        finally:
            eng.close()
    return _reference[key]


def _on_cluster(pool, n: int, tiny, trunk, backend: str, incremental: bool, streamed: bool):
    from k3core.cluster.executor import ClusterExperts

    eng = open_engine(_opts(tiny, trunk, backend, streamed))
    ex = ClusterExperts(n, pool=pool)
    lines: list[str] = []
    try:
        ex.start(eng, lines.append)
        res = generate(eng.model, PROMPT, GEN, incremental=incremental, keep_logits=True)
        record = ex.report(lines.append)
    finally:
        ex.close()
        eng.close()
    return res, record, lines


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
@pytest.mark.parametrize("n", thinned([1, 2, 3], (2, 3)))
@pytest.mark.parametrize("backend", thinned(KERNELS, ("avx2", "numpy")))
def test_same_bits_as_one_node(pool, tiny, tiny_trunk, backend, n, incremental, streamed):
    _available(backend)
    ref = _one_node(tiny, tiny_trunk, backend, incremental, streamed)
    res, record, lines = _on_cluster(pool, n, tiny, tiny_trunk, backend, incremental, streamed)
    assert res.generated_ids == ref.generated_ids
    assert len(res.step_logits) == len(ref.step_logits) == GEN
    for a, b in zip(res.step_logits, ref.step_logits, strict=True):
        assert a.dtype == b.dtype == np.float32
        assert a.tobytes() == b.tobytes()
    # the workers did the routed work, the plan covers every expert, and traffic was counted
    assert record["plan"]["workers"] == n
    assert sum(record["plan"]["experts_per_worker"]) == 12 * 8
    assert sum(s["requests"] for s in record["worker_stats"]) > 0
    assert record["round_trips_per_token"] == 12  # one round trip per MoE layer
    assert record["actor_calls"] <= n * record["round_trips"]  # at most one call a worker a layer
    assert record["bytes_received"] > 0 and record["bytes_sent"] > 0
    assert any(line.startswith("expert plan") for line in lines)
