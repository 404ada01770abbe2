"""A pass of many rows (a prompt, a speculative verify) goes to each worker as one call per
MoE layer carrying all its rows: 12 round trips and at most N calls a layer for the whole
pass, and every row's logits are one node's."""

from __future__ import annotations

import pytest

from k3core.run.engine import open_engine
from k3core.run.request import EngineRequest

IDS = [(7 * i + 3) % 1000 for i in range(24)]


@pytest.mark.parametrize("n", [2, 3])
def test_all_rows_of_a_pass_in_one_call_per_worker_per_layer(pool, tiny, n):
    from k3core.cluster.executor import ClusterExperts

    req = EngineRequest(model_dir=tiny, backend="numpy", storage="mmap")
    with open_engine(req) as eng:
        ref = eng.logits(IDS, all_positions=True)
    eng = open_engine(req.model_copy(update={"remote_experts": True}))
    ex = ClusterExperts(n, pool=pool)
    try:
        ex.start(eng, lambda s: None)
        out = eng.logits(IDS, all_positions=True)
        record = ex.report(lambda s: None)
    finally:
        ex.close()
        eng.close()
    assert out.shape == ref.shape == (len(IDS), ref.shape[1])
    assert out.tobytes() == ref.tobytes()
    assert record["forward_passes"] == 1 and record["round_trips"] == 12
    assert record["actor_calls"] == n * 12  # 24 rows x top-2 reach every worker, once a layer
