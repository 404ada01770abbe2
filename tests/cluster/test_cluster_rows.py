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


def test_batched_generations_on_expert_workers_keep_their_lone_bytes(pool, tiny):
    """Several generations batched on one engine whose routed experts run on workers: each
    prompt's ids and first logits are those it gets alone on one node."""
    from k3core.cluster.executor import ClusterExperts

    prompts = [[3, 7, 11, 5], [9, 2], [2, 14, 8, 1, 6, 6, 30], [40, 41, 40]]
    params = {"max_tokens": 5, "ignore_eos": True, "temperature": 0.9, "top_k": 20, "seed": 3}
    req = EngineRequest(model_dir=tiny, backend="numpy", storage="mmap")
    with open_engine(req) as eng:
        alone = [eng.generate(p, **(params | {"seed": 3 + i})) for i, p in enumerate(prompts)]
    eng = open_engine(req.model_copy(update={"remote_experts": True}))
    ex = ClusterExperts(2, pool=pool)
    try:
        ex.start(eng, lambda s: None)
        eng.model.scheduler.gather = 1.0  # a slow machine still forms the batch
        got = eng.generate_batch(prompts, max_batch=len(prompts), **params)
        most = eng.model.scheduler.stats.most
    finally:
        ex.close()
        eng.close()
    assert [g.ids for g in got] == [a.ids for a in alone]
    assert [g.first_logits.tobytes() for g in got] == [a.first_logits.tobytes() for a in alone]
    assert most > 1, "the prompts were batched"
