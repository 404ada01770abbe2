"""Cache policies on real routing: traces of trained demo models, one per routing pattern k3
produces, replayed both ways ``k3 sim-cache`` replays a visit.

Two sets of fixtures (gzipped ``expert_trace.bin``; ``python tools/cache_traces.py demo-model
DIR`` records every pattern, docs/expert-cache.md "Routing patterns"):

- ``data/demo_*``: the shipped demo model (demo-model/MODEL_CARD.md, trained 2026-12-07 on
  code, prose and chat), recorded by ``tools/cache_traces.py`` with its defaults;
- ``data/demo1_*``: the first demo model (2026-12-01, trained on the standard library alone),
  the routing the policy work of docs/expert-cache.md was measured and tuned on.

Both sets hold the structural facts and Belady's bound. The figures docs/expert-cache.md
reports for the default policy are asserted on ``demo1``, where they were measured; on the
shipped model's routing the default falls short of half the gap at some sizes
(docs/measurements/2026-12-07-demo-model-v2.md records them), which the tests below record
as that, not as the bar. The ``demo1`` fixtures were recorded as:

``data/demo_generate_trace.bin.gz``: one-row decode: ``k3 run demo-model --prompt-file
demo-model/prompt.txt --gen 512 --incremental --dump-cache-trace DIR`` (519 positions, 7 MoE
layers x top-4).
``data/demo_prompt_trace.bin.gz``: the first 2,400 bytes of the held-out ``shlex.py`` as the
prompt (821 ids, prefilled in one pass), then 32 generated tokens, incremental.
``data/demo_prefill_trace.bin.gz``: chunked prefill: the first 12,000 bytes of ``shlex.py``
(2,955 ids) fed in passes of 256 ids, prefill only.
``data/demo_batch4_trace.bin.gz``, ``data/demo_batch16_trace.bin.gz``: batched decode:
``Engine.generate_batch`` over 4 and 16 held-out prompts of 200 bytes, 64 tokens each.

The figures asserted are the ones docs/expert-cache.md reports.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3core.experts.simulator import BELADY, SERVE_MODES, SimResult, simulate
from k3core.experts.trace import read_trace

DATA = Path(__file__).parent / "data"
SLOTS = (8, 16, 32, 64, 128)
TOPK = 4
FILES = {"decode": "generate", "prompt": "prompt", "prefill": "prefill", "batch4": "batch4",
         "batch16": "batch16"}
PATTERNS = list(FILES)
#: positions of the single-row patterns, per model (None: not pinned)
POSITIONS = {"demo1": {"decode": 519, "prompt": 852}, "demo": {"decode": 518}}
MODELS = tuple(POSITIONS)
#: the patterns the default must do well on (the issue's list): at least half of the gap
REQUIRED = ("decode", "prefill", "batch4", "batch16")


def load(name: str, model: str = "demo1") -> np.ndarray:
    return read_trace(DATA / f"{model}_{FILES[name]}_trace.bin.gz", n_layers=8, n_experts=64)


_results: dict[tuple[str, str, str], SimResult] = {}


def result(name: str, serve: str, model: str = "demo1") -> SimResult:
    if (name, serve, model) not in _results:
        _results[name, serve, model] = simulate(
            load(name, model), slots_list=SLOTS, topk=TOPK, n_layers=8, n_experts=64,
            policies=["cycle-eta", "lru"], serve=serve)
    return _results[name, serve, model]


def gap_closed(rate: dict[str, float], policy: str = "cycle-eta") -> float | None:
    """The share of the LRU-to-Belady gap ``policy`` closes; None where there is no gap to
    speak of (under a tenth of a point: the sizes that hold a pattern's working set)."""
    gap = rate[BELADY] - rate["lru"]
    return None if gap < 1e-3 else (rate[policy] - rate["lru"]) / gap


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", PATTERNS)
def test_traces_are_whole_positions_of_the_seven_moe_layers(name, model):
    pairs = load(name, model)
    assert set(np.unique(pairs[:, 0]).tolist()) == set(range(1, 8))  # layer 0 is dense
    cuts = np.flatnonzero(np.diff(pairs[:, 0])) + 1
    sizes = np.diff(np.r_[0, cuts, len(pairs)])
    assert (sizes % TOPK == 0).all()  # every visit is whole rows of top-4
    positions = POSITIONS[model].get(name)
    if positions is not None:
        assert len(pairs) == positions * 7 * TOPK
    if name.startswith("batch"):  # batched steps: a visit of one row per running sequence
        assert sizes.max() >= int(name.removeprefix("batch")) * TOPK


@pytest.mark.parametrize("model", MODELS)
def test_real_routing_is_skewed(model):
    pairs = load("decode", model)
    keys = pairs[:, 0] * 64 + pairs[:, 1]
    counts = np.bincount(keys, minlength=8 * 64)[64:]
    assert (counts > 0).sum() < 7 * 64  # some experts never come up in a long generation
    assert counts.max() > 5 * counts[counts > 0].mean()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("serve", SERVE_MODES)
@pytest.mark.parametrize("name", PATTERNS)
def test_belady_bounds_every_policy(name, serve, model):
    for row in result(name, serve, model).rows:
        for policy, rate in row.hit_rate.items():
            assert rate <= row.hit_rate[BELADY] + 1e-12, (row.slots, policy)


@pytest.mark.parametrize("serve", SERVE_MODES)
@pytest.mark.parametrize("name", REQUIRED)
def test_the_default_closes_half_the_gap_on_every_pattern(name, serve):
    """The issue's bar: on one-row decode, chunked prefill and batched decode at B = 4 and 16,
    the default policy closes at least half of the LRU-to-Belady gap at every size below the
    pattern's working set, replayed request by request and as the engine serves a visit."""
    closed = {row.slots: gap_closed(row.hit_rate) for row in result(name, serve).rows}
    assert any(c is not None for c in closed.values())
    for slots, c in closed.items():
        assert c is None or c >= 0.5, (slots, closed)


def test_cycle_eta_closes_most_of_the_gap_on_long_generation():
    for serve in SERVE_MODES:
        for row in result("decode", serve).rows:
            c = gap_closed(row.hit_rate)
            assert c is not None and c >= 0.75, (serve, row.slots)


def test_within_a_many_row_visit_the_default_is_belady():
    """Request by request, a prefill chunk's later requests are known (``begin_layer``):
    the default keeps what the chunk needs soonest, within 2 % of the gap of Belady."""
    for row in result("prefill", "requests").rows:
        c = gap_closed(row.hit_rate)
        assert c is None or c >= 0.9, row.slots


@pytest.mark.parametrize("model", MODELS)
def test_the_engine_reads_each_expert_once_per_visit(model):
    """Served as the engine serves it, a prefill chunk of 256 rows asks each of its distinct
    experts once: whatever the policy, nearly every request is a repeat, so the hit rates sit
    far above the request-by-request ones at small sizes."""
    by_request = {r.slots: r.hit_rate for r in result("prefill", "requests", model).rows}
    by_visit = {r.slots: r.hit_rate for r in result("prefill", "visits", model).rows}
    for s in (8, 16, 32):
        assert by_visit[s]["lru"] > 0.9 > by_request[s]["lru"]
        assert by_visit[s]["cycle-eta"] >= by_visit[s]["lru"]


def test_a_prompt_then_decode_stays_ahead_of_lru():
    """A prefilled prompt and the decode after it: the default is ahead of LRU at every size
    both ways (the decode's first tokens ask for experts the prompt did not favour: the gap
    left there is the part docs/expert-cache.md says is still open)."""
    for serve in SERVE_MODES:
        for row in result("prompt", serve).rows:
            assert row.hit_rate["cycle-eta"] > row.hit_rate["lru"], (serve, row.slots)


@pytest.mark.parametrize("serve", SERVE_MODES)
def test_the_shipped_models_gaps_are_as_recorded(serve):
    """On the shipped model's routing the default is what
    docs/measurements/2026-12-07-demo-model-v2.md records: ahead of LRU wherever there is a gap on decode,
    batched decode and a chunked prefill at the small sizes, short of half the gap at some."""
    for name in REQUIRED:
        rows = result(name, serve, "demo").rows
        assert any(gap_closed(r.hit_rate) is not None for r in rows), name
        small = [gap_closed(r.hit_rate) for r in rows if r.slots <= 32]
        assert all(c is None or c > 0 for c in small), (name, small)
