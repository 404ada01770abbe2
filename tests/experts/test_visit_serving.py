"""A layer visit of many rows as the engine serves it: each expert once (one use multiplies
every row routed to it), so the cache tells the policy each key once, and ``k3 sim-cache
--serve visits`` replays exactly that: on a real run it gives the engine's misses to the
request. Also: a batched run's trace holds every row's requests (tools/cache_traces.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence
from pathlib import Path

import numpy as np
import pytest

from k3core.api.cache_policy import make_key
from k3core.experts.simulator import simulate
from k3core.model.config import load_config
from k3core.run.engine import Engine, open_engine
from k3core.run.plan import EnginePlan
from k3core.run.request import EngineRequest, build
from k3core.testing.expert_cache_conformance import (
    ScriptedPolicy,
    drive,
    make_policy,
    make_storage,
    model_cache,
)
from k3core.testing.faulty_backend import available_storage

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
PROMPT = "\n".join(f"    def read_token{i}(self):\n        raw = self.read_token()\n"
                  f"        if raw == self.eof:\n            return {i}\n" for i in range(24))


class Spy(ScriptedPolicy):
    """Records what the cache tells the policy."""

    def __init__(self, inner, events: list[tuple[str, object]]):
        super().__init__(inner)
        self.events = events

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        self.events.append(("begin_layer", list(keys)))
        super().begin_layer(layer, keys)

    def on_hit(self, key: int) -> None:
        self.events.append(("on_hit", key))
        super().on_hit(key)

    def admit(self, key: int, protected: Container[int]) -> bool:
        self.events.append(("admit", key))
        return super().admit(key, protected)


def test_the_cache_tells_the_policy_each_key_once_per_visit() -> None:
    cfg = load_config(DEMO)
    events: list[tuple[str, object]] = []
    inner = make_policy("lru", 6, n_layers=cfg.n_layers, n_experts=cfg.n_experts, topk=cfg.topk)
    rig = model_cache(DEMO, make_storage(available_storage()[0]), Spy(inner, events), 6)
    try:
        rows = [5, 1, 9, 2, 5, 7, 1, 3, 9, 2, 5, 7]  # three rows of top-4
        drive(rig, [[(1, rows)]])
        k = {e: make_key(1, e) for e in rows}
        assert events[0] == ("begin_layer", [k[5], k[1], k[9], k[2], k[7], k[3]])
        admitted = [key for what, key in events if what == "admit"]
        assert admitted == [k[5], k[1], k[9], k[2], k[7], k[3]]  # each once, never a repeat
        stats = rig.cache.stats
        assert stats.misses == 6 and stats.extra["reuse"] == 6 and stats.hits == 0
    finally:
        rig.close()


def open_recording(out: Path, **fields: object) -> Engine:
    def record(plan: EnginePlan) -> None:
        plan.trace_dir = out

    return open_engine(build(EngineRequest, {"model_dir": str(DEMO), "given_as": "keyword",
                                             **fields}), on_plan=record)


@pytest.mark.parametrize("policy", ["cycle-eta", "lru"])
def test_the_visits_replay_gives_the_engines_misses(policy: str, tmp_path: Path) -> None:
    slots = 9
    slot_bytes = 12_288  # the demo model's slot
    with open_recording(tmp_path, cache_policy=policy, cache_gb=(slots * slot_bytes + 1) / 1e9
                        ) as engine:
        engine.generate(PROMPT, max_tokens=4, temperature=0.0)
        cache = engine.experts
        assert cache.capacity == slots  # type: ignore[attr-defined]
        misses = cache.stats.misses  # type: ignore[attr-defined]
        pairs = cache.recorder.pairs()  # type: ignore[attr-defined]
    assert misses < 0.2 * len(pairs)  # the prompt is one pass of a few hundred rows
    got = {}
    for serve in ("visits", "requests"):
        r = simulate(pairs, slots_list=[slots], policies=[policy], topk=4, n_layers=8,
                     n_experts=64, serve=serve)
        got[serve] = round((1.0 - r.rows[0].hit_rate[policy]) * len(pairs))
    assert got["visits"] == misses
    assert got["requests"] > 2 * misses  # request by request, repeats are read again


def test_a_batched_run_records_every_rows_requests(tmp_path: Path) -> None:
    """A batched step asks each layer for the union of its rows' experts, in row order: the
    trace of two prompts run together holds exactly the requests of the two run alone."""
    from tools.cache_traces import batch_prompts

    prompts = batch_prompts(2, 120)
    with open_recording(tmp_path / "both") as engine:
        engine.generate_batch(prompts, max_batch=2, max_tokens=3, temperature=0.0,
                              ignore_eos=True)
        both = engine.experts.recorder.pairs()  # type: ignore[attr-defined]
    alone: Counter[tuple[int, int]] = Counter()
    for i, p in enumerate(prompts):
        with open_recording(tmp_path / str(i)) as engine:
            engine.generate(p, max_tokens=3, temperature=0.0, ignore_eos=True)
            alone.update(map(tuple, engine.experts.recorder.pairs().tolist()))  # type: ignore[attr-defined]
    assert Counter(map(tuple, both.tolist())) == alone
    cuts = np.flatnonzero(np.diff(both[:, 0])) + 1
    assert np.diff(np.r_[0, cuts, len(both)]).max() >= 2 * 4  # a visit held both rows
