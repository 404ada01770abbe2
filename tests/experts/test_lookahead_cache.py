"""Router lookahead in the expert cache (``ExpertCache.lookahead``): a guess is only a read.

It never evicts an expert in use (the visit being served), guessed (another guess still
reading) or due this step (a layer after the one being served), under every registered
policy; a guessed read the real request wants is adopted with the right bytes, one it does
not want is cancelled or kept as an ordinary resident expert and counted as wasted; a guess
whose read fails is dropped without failing the run; the counters add up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from k3core.api.cache_policy import key_layer, make_key
from k3core.api.experts import ExpertWeights
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.plugins.registry import get_registry
from k3core.testing.disk import disk_tmpdir
from k3core.testing.expert_cache_conformance import (
    Rig,
    check_resident,
    make_storage,
    model_cache,
    served_bytes,
)
from k3core.testing.faults import FaultInjector
from k3core.tools.synth.writer import synthesize

TOPK = 4
POLICIES = [p for p in get_registry().names("cache") if p != "replay"]


@pytest.fixture(scope="module")
def model():
    with disk_tmpdir("k3-lookahead-") as d:
        cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 32,
                                                              "num_experts_per_token": TOPK}))
        yield synthesize(d / "tiny32", cfg, 3)


def serve(rig: Rig, layer: int, requests: list[int]) -> list[int]:
    used: list[int] = []

    def use(e: int, w: ExpertWeights) -> None:
        used.append(e)
        assert served_bytes(w) == rig.truth.expert(layer, e), f"expert {layer}/{e}: wrong bytes"

    rig.cache.run_layer(layer, requests, use)
    assert sorted(used) == sorted(set(requests))
    return used


def settle(rig: Rig) -> None:
    for g in list(rig.cache.guesses.pending.values()):
        try:
            g.future.result(timeout=30)
        except Exception:
            pass


@pytest.mark.parametrize("policy", POLICIES)
def test_a_guess_never_evicts_in_use_or_due_experts(model: Path, policy: str) -> None:
    rig = model_cache(model, make_storage("plain"), policy, 12)
    c = rig.cache
    try:
        c.begin_step()
        c.prefetch(1, [0, 1, 2, 3])
        serve(rig, 1, [0, 1, 2, 3])
        # layer 5 resident before layer 2 is served: due later this step
        c.prefetch(5, [20, 21, 22, 23])
        serve(rig, 5, [20, 21, 22, 23])
        c.begin_step()
        c.prefetch(2, [4, 5, 6, 7])  # in use: routed, not yet computed
        in_use = {make_key(2, e) for e in (4, 5, 6, 7)}
        due = {make_key(5, e) for e in (20, 21, 22, 23)}
        c.lookahead(3, [8, 9, 10, 11, 12, 13, 14, 15])  # more than the free + evictable slots
        resident = set(c.slot_of)
        assert in_use <= resident and due <= resident, "a guess evicted a protected expert"
        guessed = {k for k in resident if key_layer(k) == 3}
        # only layer 1's four experts (already served this step's predecessor) were evictable
        assert len(guessed) == 4 and c.stats.extra["lookahead_skipped"] == 4
        serve(rig, 2, [4, 5, 6, 7])
        c.prefetch(3, [8, 9, 10, 11])
        serve(rig, 3, [8, 9, 10, 11])
        settle(rig)
        c.begin_step()
        check_resident(rig)
        x = c.stats.extra
        assert x["lookahead_reads"] == 4 and x["lookahead_real"] == 4
        assert x["lookahead_recalled"] == 4
        assert x["lookahead_used"] == 4
        assert c.stats.requests == c.stats.hits + c.stats.misses + x["reuse"]
    finally:
        rig.close()


def test_unwanted_guesses_are_cancelled_or_counted_as_wasted(model: Path) -> None:
    rig = model_cache(model, make_storage("plain"), "lru", 16)
    c = rig.cache
    try:
        c.begin_step()
        c.prefetch(1, [0, 1, 2, 3])
        c.lookahead(2, [4, 5, 30, 31])
        serve(rig, 1, [0, 1, 2, 3])
        c.prefetch(2, [4, 5, 6, 7])
        serve(rig, 2, [4, 5, 6, 7])
        settle(rig)
        c.begin_step()
        x = c.stats.extra
        assert x["lookahead_recalled"] == 2 and x["lookahead_real"] == 4
        assert x["lookahead_used"] == 2
        unwanted = 2 * c.locator.ref(2, 30).nbytes
        assert x["lookahead_wasted_bytes"] + x["lookahead_cancelled"] * unwanted // 2 == unwanted
        assert not c.guesses.pending
        check_resident(rig)
        # what a kept guess left is an ordinary resident expert: a hit in a later step
        if make_key(2, 30) in c.slot_of:
            hits = c.stats.hits
            c.prefetch(2, [30, 4, 5, 6])
            serve(rig, 2, [30, 4, 5, 6])
            assert c.stats.hits == hits + 4
    finally:
        rig.close()


def test_a_failed_guess_is_dropped_and_the_real_request_reads_again(model: Path) -> None:
    probe = model_cache(model, make_storage("plain"), "lru", 8)
    ref = probe.cache.locator.ref(2, 9)
    probe.close()
    faulty = FaultInjector(make_storage("plain"), fail_range=(ref.offset, ref.offset + 1))
    rig = model_cache(model, faulty, "lru", 8)
    c = rig.cache
    try:
        c.begin_step()
        c.lookahead(2, [9, 10])
        settle(rig)
        assert faulty.injected, "the guessed read of 2/9 was not failed"
        faulty.heal()
        c.prefetch(2, [9, 10, 11, 12])
        serve(rig, 2, [9, 10, 11, 12])
        assert c.stats.drops == 0
        assert c.stats.extra["lookahead_used"] == 1  # 10; 9's guess failed and was re-read
        check_resident(rig)
    finally:
        rig.close()


def test_lookahead_of_a_layer_already_resident_reads_nothing(model: Path) -> None:
    rig = model_cache(model, make_storage("plain"), "lru", 8)
    c = rig.cache
    try:
        c.begin_step()
        c.prefetch(2, [1, 2, 3, 4])
        serve(rig, 2, [1, 2, 3, 4])
        c.begin_step()
        before = c.stats.bytes_read
        c.lookahead(2, [1, 2, 3, 4])
        assert c.stats.extra["lookahead_resident"] == 4 and not c.guesses.pending
        assert c.stats.bytes_read == before
    finally:
        rig.close()
