"""Generations batched on one engine give each prompt the ids and first-logit bytes it gets
alone, in every mode: a streamed trunk at its floor, each storage backend, each cache
policy, a small cache with its reader threads and lookahead, full recompute, speculative
decoding, seeded sampling (each row its own draw); and a prefix cache's kept state gives a
fresh run's bytes. (Remote expert workers: tests/cluster/test_cluster_rows.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from thin import SLOW
from typer.testing import CliRunner

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.engine import open_engine
from k3core.run.prefix_cache import PrefixCache
from k3core.run.request import EngineRequest, GenerationParams
from k3core.serve.worker import PREFIX_BLOCK, Job, Worker
from k3core.tools.synth.writer import synthesize

PROMPTS = [[3, 7, 11, 5], [9, 2], [2, 14, 8, 1, 6, 6, 30, 4, 12], [40, 41, 40, 41, 40], [5]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    from k3core.cli.app import app

    root = tmp_path_factory.mktemp("batched-gen")
    m = synthesize(root / "tiny", ModelConfig.from_json_dict(size_config("tiny")), seed=4)
    res = CliRunner().invoke(app, ["pack-trunk", str(m), str(root / "trunk"), "-q"])
    assert res.exit_code == 0, res.output
    return m, root / "trunk"


MODES = {
    "resident": {},
    "streamed": {"trunk": "TRUNK", "trunk_gb": 0.00015},
    "lru-small-cache": {"cache_policy": "lru", "cache_gb": 0.0002, "expert_readers": 2,
                        "lookahead": "on"},
    "s3fifo": {"cache_policy": "s3fifo", "cache_gb": 0.0003},
    "full-recompute": {"incremental": False},
    # each storage backend that reads a streamed trunk and a small cache's misses
    "direct": {"storage": "direct", "trunk": "TRUNK", "trunk_gb": 0.00015, "cache_gb": 0.0002},
    "mmap": {"storage": "mmap", "trunk": "TRUNK", "trunk_gb": 0.00015, "cache_gb": 0.0002},
}
#: the modes of the default suite (the rest: make test-long)
QUICK = ("resident", "streamed", "direct")


def _engine(model, trunk, extra):
    kw = {"storage": "plain"} | {k: (trunk if v == "TRUNK" else v) for k, v in extra.items()}
    return open_engine(EngineRequest(model_dir=model, backend="numpy", **kw))


@pytest.mark.parametrize("mode", [m if m in QUICK else pytest.param(m, marks=SLOW)
                                  for m in MODES])
@pytest.mark.parametrize("how", ["greedy", "sampled", "spec"])
def test_a_batch_gives_each_prompt_its_lone_bytes(model, mode, how):
    m, trunk = model
    params = {"max_tokens": 6, "ignore_eos": True}
    if how == "sampled":
        params |= {"temperature": 0.9, "top_k": 20, "seed": 11}
    if how == "spec":
        params |= {"spec": "ngram"}
    eng = _engine(m, trunk, MODES[mode])
    try:
        alone = []
        for i, p in enumerate(PROMPTS):
            seed = {"seed": params["seed"] + i} if "seed" in params else {}
            alone.append(eng.generate(p, **(params | seed)))
        eng.model.scheduler.gather = 1.0  # a slow machine still forms the batch
        got = eng.generate_batch(PROMPTS, max_batch=len(PROMPTS), **params)
        assert [g.ids for g in got] == [a.ids for a in alone]
        assert [g.first_logits.tobytes() for g in got] == [a.first_logits.tobytes() for a in alone]
        assert eng.model.scheduler.stats.most > 1, "the prompts were batched"
    finally:
        eng.close()


def test_a_kept_prefix_gives_a_fresh_runs_bytes(model):
    m, _ = model
    eng = _engine(m, None, {})
    try:
        w = Worker(eng, 256, PrefixCache(10**8))
        system = [(7 * i) % 50 + 1 for i in range(PREFIX_BLOCK)]  # a shared opening
        a = w.run(Job(system + [4, 4], GenerationParams(max_tokens=5)))
        assert a.reused == 0
        b = w.run(Job(system + [6, 1, 2], GenerationParams(max_tokens=5)))
        assert b.reused == len(system)  # the state kept at the block boundary
        assert w.last_generation.first_logits.tobytes() == eng.logits(system + [6, 1, 2]).tobytes()
        assert b.ids == eng.generate(system + [6, 1, 2], max_tokens=5).ids
        same = w.run(Job(system + [6, 1, 2], GenerationParams(max_tokens=5)))  # sent twice
        assert same.reused == len(system) + 3 and same.ids == b.ids
        again = w.last_generation  # its first pick from the kept logits, no pass at all
        assert again.prefill_chunks == 0
        assert again.first_logits.tobytes() == eng.logits(system + [6, 1, 2]).tobytes()
        turn = system + [6, 1, 2] + b.ids + [3]  # a chat turn sending back the reply
        c = w.run(Job(turn, GenerationParams(max_tokens=4)))
        assert c.reused == len(turn) - 2
        assert c.ids == eng.generate(turn, max_tokens=4).ids
        assert w.prefix.stats.hits == 3
    finally:
        eng.close()


def test_the_prefix_cache_keeps_to_its_budget():
    from k3core.model.state import SequenceState

    cfg = ModelConfig.from_json_dict(size_config("tiny"))
    st = SequenceState(cfg, 8)
    st.kda_state(0)
    st.kv_cache(1)
    st.pos = 3
    one = PrefixCache(10**9)
    one.store([1, 2, 3], st)
    size = one.bytes
    cache = PrefixCache(2 * size + 1)
    for start in range(4):
        cache.store([start, 2, 3], st)
    assert len(cache) == 2 and cache.bytes <= cache.budget and cache.stats.evicted == 2
    assert cache.peek([3, 2, 3, 9]) == 3 and cache.peek([0, 2, 3, 9]) == 0  # LRU went first
    assert not PrefixCache(size - 1).store([1, 2, 3], st)  # a state over the budget is not kept
