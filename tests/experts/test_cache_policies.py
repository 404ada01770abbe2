"""Cache policies: the shared conformance suite for every built-in, then each one's own rules."""

from __future__ import annotations

import re

import numpy as np
import pytest
from k3_caches.cycle_eta import CycleETAPolicy
from k3_caches.lru import LRUPolicy
from k3_caches.replay import ReplayPolicy
from k3_caches.s3fifo import S3FIFOPolicy

from k3core.api.cache_policy import CachePolicy, key_expert, key_layer, make_key
from k3core.api.errors import K3Error, PluginError
from k3core.experts.simulator import TraceView, belady_hits, replay_policy
from k3core.experts.trace import trace_keys
from k3core.plugins.registry import get_registry
from k3core.testing.cache_policy_conformance import (
    CachePolicyConformance,
    ContractViolation,
    checked_replay,
    small_traces,
)
from k3core.testing.synthetic_trace import full_recompute_trace, incremental_trace, routing

BUILTINS = ["cycle-eta", "lru", "replay", "s3fifo"]

# every registered policy, built-in or installed, with no list kept by hand
def _runnable(policy: str) -> object:
    """An autouse fixture: skip (with the registry's reason) a policy that cannot run here."""
    @pytest.fixture(autouse=True)
    def runnable(self: object) -> None:
        reg = get_registry()
        if policy not in reg.available("cache"):
            pytest.skip(f"cache policy '{policy}' cannot run here: {reg.probe('cache', policy).reason}")
    return runnable


for _name in get_registry().names("cache"):
    _cls = "TestConformance_" + re.sub(r"\W", "_", _name)
    globals()[_cls] = type(_cls, (CachePolicyConformance,), {"policy_name": _name,
                                                             "__module__": __name__,
                                                             "_runnable": _runnable(_name)})


def test_every_registered_policy_runs_the_conformance_suite() -> None:
    covered = {c.policy_name for c in CachePolicyConformance.__subclasses__()
               if c.__module__ == __name__ and c.policy_name}
    assert covered == set(get_registry().names("cache")) and set(BUILTINS) <= covered


class TestCycleETAShortMemoryConformance(CachePolicyConformance):
    factory = CycleETAPolicy
    options = {"horizon": 2, "max_age": 1, "shrink": 0.5}


# ---- keys and registration ----------------------------------------------------------------
def test_keys_round_trip() -> None:
    for layer, expert in [(0, 0), (1, 895), (92, 0), (2047, (1 << 20) - 1)]:
        k = make_key(layer, expert)
        assert (key_layer(k), key_expert(k)) == (layer, expert)
    assert make_key(3, 5) == 3 << 20 | 5


def test_builtins_registered_and_auto_picks_cycle_eta() -> None:
    reg = get_registry()
    assert set(BUILTINS) <= set(reg.names("cache"))
    spec, note = reg.resolve("cache", "auto")
    assert spec.name == "cycle-eta" and "cycle-eta" in note
    policy, name, _ = reg.create("cache", "lru", capacity=20, n_layers=92, n_experts=896)
    assert isinstance(policy, CachePolicy) and name == "lru"


def test_unknown_policy_names_the_registered_ones() -> None:
    with pytest.raises(PluginError, match="registered: .*lru"):
        get_registry().resolve("cache", "lruu")


def test_replay_without_a_trace_is_refused() -> None:
    with pytest.raises(PluginError, match="needs a trace"):
        ReplayPolicy(10)
    with pytest.raises(PluginError, match=r"\(N, 2\) integer array"):
        ReplayPolicy(10, trace=np.zeros((3, 3), dtype=np.int32))


def test_replay_reads_a_trace_file(tmp_path) -> None:
    from k3core.experts.trace import write_trace

    pairs = small_traces()["full-recompute"]
    write_trace(tmp_path, pairs)
    p = ReplayPolicy(12, trace=tmp_path / "expert_trace.bin", n_layers=6, n_experts=40)
    starts = TraceView.of(pairs).batch_starts(4)
    assert checked_replay(p, pairs, 12) == belady_hits(trace_keys(pairs), 12, batch_starts=starts)


def test_bad_cycle_eta_options_refused() -> None:
    with pytest.raises(K3Error, match="horizon"):
        CycleETAPolicy(10, horizon=1)
    with pytest.raises(K3Error, match="shrink"):
        CycleETAPolicy(10, shrink=0)


# ---- LRU ----------------------------------------------------------------------------------
def test_lru_evicts_least_recent_unprotected() -> None:
    p = LRUPolicy(3)
    for k in (1, 2, 3):
        p.on_insert(k)
    p.on_hit(1)
    assert p.choose_victim(set()) == 2
    assert p.choose_victim({2}) == 3
    assert p.choose_victim({1, 2, 3}) is None


# ---- S3-FIFO ------------------------------------------------------------------------------
def test_s3fifo_small_queue_ghost_and_promotion() -> None:
    p = S3FIFOPolicy(10)  # small target 1
    for k in range(10):
        assert p.admit(k, set())
        p.on_insert(k)
    p.on_hit(0)  # touched while in small: promoted to main instead of evicted
    v = p.choose_victim(set())
    assert v == 1
    p.on_evict(v)  # evicted from small: remembered in the ghost
    p.on_insert(10)
    p.on_evict(p.choose_victim(set()) or -1)
    p.on_insert(1)  # a ghost hit goes straight to main
    assert p._where[1][0] == 1
    assert "ghost" in p.describe()


def test_s3fifo_matches_the_references_figures_on_a_synthetic_trace() -> None:
    # a direct transcription of the published rules (no protection needed at these sizes)
    from collections import deque

    keys = trace_keys(small_traces()["incremental-skewed"]).tolist()

    def reference(cap: int) -> int:
        small = max(1, int(cap * 0.1))
        S: deque[int] = deque()
        M: deque[int] = deque()
        ghost: dict[int, None] = {}
        freq: dict[int, int] = {}
        hits = 0
        for k in keys:
            if k in freq:
                hits += 1
                freq[k] = min(freq[k] + 1, 3)
                continue
            while len(freq) >= cap:
                if S and (len(S) >= small or not M):
                    v = S.popleft()
                    if freq[v] > 0:
                        freq[v] = 0
                        M.append(v)
                        continue
                    del freq[v]
                    ghost[v] = None
                    if len(ghost) > cap:
                        del ghost[next(iter(ghost))]
                    break
                v = M.popleft()
                if freq[v] > 0:
                    freq[v] -= 1
                    M.append(v)
                    continue
                del freq[v]
                break
            freq[k] = 0
            if k in ghost:
                del ghost[k]
                M.append(k)
            else:
                S.append(k)
        return hits

    view = TraceView.of(small_traces()["incremental-skewed"])
    for cap in (20, 40, 80):  # topk=1: nothing protected, as in the reference's simulator
        assert replay_policy(S3FIFOPolicy(cap), view, cap, topk=1) == reference(cap)


# ---- replay -------------------------------------------------------------------------------
def test_replay_equals_belady_on_a_repeated_run() -> None:
    # exactly Belady under the same protection rule, never above the unconstrained ceiling
    for pairs in small_traces().values():
        keys, starts = trace_keys(pairs), TraceView.of(pairs).batch_starts(4)
        for cap in (8, 20, 60):
            got = checked_replay(ReplayPolicy(cap, trace=pairs), pairs, cap)
            assert got == belady_hits(keys, cap, batch_starts=starts)
            assert got <= belady_hits(keys, cap)


def test_replay_resynchronises_after_a_skipped_stretch() -> None:
    pairs = small_traces()["incremental-sticky"]
    live = np.concatenate([pairs[:300], pairs[340:]])  # the live run skips 40 requests
    p = ReplayPolicy(20, trace=pairs)
    hits = checked_replay(p, live, 20)
    assert p.resyncs >= 1 and p.in_sync
    assert hits >= 0.97 * belady_hits(trace_keys(live), 20)


def test_replay_falls_back_to_lru_on_a_different_run() -> None:
    recorded = incremental_trace(6, 40, 4, 40, skew=0.5, seed=11)
    live = incremental_trace(6, 40, 4, 40, skew=0.5, seed=12)
    live[:, 1] += 40  # another model's experts: nothing matches the recording
    p = ReplayPolicy(20, trace=recorded, n_experts=80, sync_window=100)
    hits = checked_replay(p, live, 20)
    lru = checked_replay(LRUPolicy(20), live, 20)
    assert not p.in_sync and "LRU fallback" in p.describe()
    assert p.unsynced > 0
    assert hits >= 0.8 * lru  # still a working cache, only residency differs


# ---- cycle-eta ----------------------------------------------------------------------------
def test_cycle_eta_keeps_a_stable_set_on_a_pure_cycle() -> None:
    # every pass asks for the same 10 experts in each of 6 layers; 30 slots hold half of it:
    # LRU evicts each expert just before it comes round, cycle-eta keeps 30 and hits them
    pairs = np.array(
        [(layer, e) for _ in range(12) for layer in range(1, 7) for e in range(10)],
        dtype=np.int32,
    )
    view = TraceView.of(pairs)
    assert replay_policy(LRUPolicy(30), view, 30, topk=10) == 0
    got = replay_policy(CycleETAPolicy(30, n_layers=6, n_experts=10), view, 30, topk=10)
    assert got >= 29 * 11  # ~30 hits on each pass after the first
    assert belady_hits(trace_keys(pairs), 30) >= got


def test_cycle_eta_learns_locality_and_popularity() -> None:
    sticky = incremental_trace(8, 64, 4, 120, skew=0.3, stickiness=0.6, seed=4)
    skewed = incremental_trace(8, 64, 4, 120, skew=1.2, seed=4)
    for pairs, cap in ((sticky, 40), (skewed, 40), (skewed, 120)):
        view = TraceView.of(pairs)
        eta = replay_policy(CycleETAPolicy(cap, n_layers=8, n_experts=64), view, cap, topk=4)
        lru = replay_policy(LRUPolicy(cap), view, cap, topk=4)
        assert eta > lru
    p = CycleETAPolicy(40, n_layers=8, n_experts=64)
    replay_policy(p, TraceView.of(sticky), 40, topk=4)
    h = p.hazard()
    assert h[:, 0].min() > 3 * h[:, 5].max()  # just-used experts come back far more often
    assert "cycle-eta" in p.describe()


def test_cycle_eta_merges_a_visit_announced_in_pieces() -> None:
    route = routing(6, 4, 30, 4, skew=0.5, seed=1)
    pairs = full_recompute_trace(route, 3)
    view = TraceView.of(pairs)
    whole = replay_policy(CycleETAPolicy(24, n_layers=4, n_experts=30), view, 24, topk=4)

    class Pieces(CycleETAPolicy):
        def begin_layer(self, layer, keys):  # the cache announces one position at a time
            for i in range(0, len(keys), 4):
                super().begin_layer(layer, keys[i : i + 4])

    pieces = replay_policy(Pieces(24, n_layers=4, n_experts=30), view, 24, topk=4)
    assert pieces == whole


def test_a_policy_breaking_the_contract_is_caught() -> None:
    class Bad(LRUPolicy):
        def choose_victim(self, protected):
            return next(iter(protected), None) or super().choose_victim(protected)

    pairs = small_traces()["full-recompute"]
    with pytest.raises(ContractViolation, match="protected"):
        checked_replay(Bad(5), pairs, 5)
    with pytest.raises(PluginError, match="protected"):
        replay_policy(Bad(5), TraceView.of(pairs), 5, topk=4)


def _drive_cycle_eta(p: CycleETAPolicy, rng: np.random.Generator, layers: int, experts: int,
                     topk: int, tokens: int, check) -> None:
    """A small cache in front of ``p``: random skewed requests, a batch of positions first;
    ``check()`` after every layer visit."""
    res: set[int] = set()
    pop = rng.dirichlet(np.ones(experts) * 0.3, size=layers)
    for t in range(tokens):
        p.begin_token()
        for layer in range(layers):
            keys = [make_key(layer, int(e)) for _ in range(6 if t == 0 else 1)
                    for e in rng.choice(experts, topk, replace=False, p=pop[layer])]
            p.begin_layer(layer, keys)
            check()
            batch: set[int] = set()
            for key in keys:
                if key in res:
                    p.on_hit(key)
                    batch.add(key)
                    continue
                if not p.admit(key, batch):
                    continue
                if len(res) >= p.capacity:
                    victim = p.choose_victim(batch | {key})
                    if victim is None:
                        continue
                    p.on_evict(victim)
                    res.discard(victim)
                p.on_insert(key)
                res.add(key)
                batch.add(key)


def test_cycle_eta_layer_predictions_are_the_per_key_ones() -> None:
    """The ETAs a layer visit refreshes in one numpy pass are ``_predict``'s, key for key
    (residents never requested, requested under another layer, of every class and age)."""
    rng = np.random.default_rng(3)
    p = CycleETAPolicy(40, n_layers=5, n_experts=24, topk=3)
    compared = 0

    def check() -> None:
        nonlocal compared
        for layer in range(5):
            keys = [make_key(layer, e) for e in range(30)]  # past n_experts too
            assert p._predict_layer(layer, keys) == [p._predict(k) for k in keys]
            compared += len(keys)

    _drive_cycle_eta(p, rng, 5, 24, 3, 40, check)
    assert compared > 0


def test_cycle_eta_victim_is_the_largest_eta_oldest_first_past_protected_keys() -> None:
    """The victim search over the residents' ETA arrays picks what a heap on ``(-ETA,
    version)`` would: the largest ETA, among equal ETAs (common: a layer's residents of one
    class and age share one) the one set longest ago, never a protected key."""
    rng = np.random.default_rng(5)
    p = CycleETAPolicy(30, n_layers=4, n_experts=20, topk=3)
    searched = tied = 0

    def check() -> None:
        nonlocal searched, tied
        residents = list(p._pos)
        order = sorted(residents, key=lambda k: (-p._eta(k), p._ver_at[p._pos[k]]))
        for n_protected in (0, 1, 5, len(residents)):
            protected = set(rng.permutation(residents)[:n_protected].tolist())
            want = next((k for k in order if k not in protected), None)
            assert p._peek_victim(protected) == want
            searched += 1
        etas = [p._eta(k) for k in residents]
        tied += len(etas) - len(set(etas))

    _drive_cycle_eta(p, rng, 4, 20, 3, 30, check)
    assert searched > 0 and tied > 0


def test_cycle_eta_position_hazard_is_the_loop_over_pairs() -> None:
    """The first pass's hazard between positions, counted for every key at once, is the
    plain loop's over each key's consecutive positions, bit for bit (repeats within a
    position, keys seen once, gaps past max_age, several layers in turn)."""
    rng = np.random.default_rng(6)
    for _ in range(200):
        topk, max_age = int(rng.integers(1, 9)), int(rng.integers(1, 20))
        p = CycleETAPolicy(10, topk=topk, max_age=max_age)
        opp, hits = np.zeros(max_age + 1), np.zeros(max_age + 1)
        for _ in range(int(rng.integers(1, 4))):
            positions = int(rng.integers(2, 60))
            keys = [int(k) for k in rng.integers(0, int(rng.integers(2, 40)), positions * topk)]
            p._learn_positions(keys)
            seen_at: dict[int, list[int]] = {}
            for i, k in enumerate(keys):
                at = seen_at.setdefault(k, [])
                if not at or at[-1] != i // topk:
                    at.append(i // topk)
            for at in seen_at.values():
                for here, there in zip(at, [*at[1:], None], strict=True):
                    gap = (positions - 1 - here) if there is None else (there - here)
                    opp[: min(gap, max_age)] += 1.0
                    if gap > max_age:
                        opp[max_age] += gap - max_age
                    if there is not None:
                        hits[min(gap - 1, max_age)] += 1.0
        assert p._pos_opp.tobytes() == opp.tobytes() and p._pos_hits.tobytes() == hits.tobytes()


def test_cycle_eta_table_is_the_loop_over_start_ages() -> None:
    """The occupancy table, built for every start age at once, is the plain loop's (holding
    from each age ``a`` for ever or for each shorter horizon), bit for bit."""
    rng = np.random.default_rng(4)
    for max_age in (1, 5, 16):
        p = CycleETAPolicy(64, n_layers=4, n_experts=16, max_age=max_age)
        opp = rng.integers(0, 50, p._opp.shape) * rng.random(p._opp.shape)
        p._opp[:] = opp
        p._hits[:] = opp * rng.random(opp.shape) * (rng.random(opp.shape) < 0.8)
        p._rebuild()
        h = p.hazard()
        top = max_age
        R = np.empty_like(h)
        R[:, top] = 1.0 / np.maximum(h[:, top], 1e-9)
        for a in range(top - 1, -1, -1):
            R[:, a] = 1.0 + (1.0 - h[:, a]) * R[:, a + 1]
        C = R.copy()
        for a in range(top + 1):
            alive, held = np.ones(h.shape[0]), np.zeros(h.shape[0])
            for age in range(a, top + 1):
                held += alive
                alive = alive * (1.0 - h[:, age])
                C[:, a] = np.minimum(C[:, a], held / np.maximum(1.0 - alive, 1e-12))
        assert p._C == C.tolist()


def test_cycle_eta_is_belady_within_one_visit() -> None:
    """A visit of many rows announces its requests in order (begin_layer): request by
    request, cycle-eta keeps what the visit needs soonest and declines what it needs no more,
    which is Belady's rule; on one visit of 200 requests among 12 experts at 4 slots it makes
    exactly Belady's hits (it used to rank the visit's keys by when they were last set, and
    made about 60 % of them)."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        pairs = np.stack([np.ones(200, dtype=np.int32),
                          rng.integers(0, 12, 200).astype(np.int32)], axis=1)
        view = TraceView.of(pairs)
        got = replay_policy(CycleETAPolicy(4, n_layers=2, n_experts=12, topk=1), view, 4, topk=1)
        assert got == belady_hits(trace_keys(pairs), 4)


def test_replay_counts_next_use_from_the_next_visit_when_told_each_key_once() -> None:
    """Served as the engine serves a visit (each key once, ``begin_layer`` says so), a key's
    repeats in its visit cost nothing, so its next use is its next visit: replay then makes
    Belady's hits over the visits' distinct keys (it held keys for their repeats before)."""
    from k3core.experts.simulator import replay

    rng = np.random.default_rng(1)
    pairs = np.array([(layer, int(e)) for _ in range(6) for layer in (1, 2, 3) for _ in range(8)
                      for e in rng.choice(10, 2, replace=False)], dtype=np.int32)
    view = TraceView.of(pairs)
    walked = view.visit_keys()
    for cap in (3, 5, 8):
        got = replay(ReplayPolicy(cap, trace=pairs, n_layers=4, n_experts=10), view, cap, topk=2,
                     serve="visits")
        assert got.hits == belady_hits(walked, cap) + len(pairs) - len(walked), cap
