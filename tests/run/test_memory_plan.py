"""The memory plan: rows, the reference's figures for Kimi K3, and both refusals."""

from __future__ import annotations

import pytest

from k3core.api.errors import MemoryPlanError, UsageError
from k3core.api.units import ALIGN, align_up, gb_bytes, human
from k3core.experts.setup import expert_slots
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import EXPERT_BYTES, sizes_from_config, slot_bytes
from k3core.model.state import (
    expanded_kv_bytes_per_position,
    kv_bytes_per_position,
    recurrent_bytes_per_layer,
)
from k3core.run.memory_plan import MemoryRequest, check_kv, kv_bytes, plan_memory

GB = 1_000_000_000
K3 = ModelConfig.from_json_dict(size_config("real"))
TINY = ModelConfig.from_json_dict(size_config("tiny"))


def plan(cfg=K3, **kw):
    args = dict(streamed=True, trunk_budget=3 * GB, cache_bytes=1 * GB, prompt_len=5, gen=8,
                incremental=True, baseline=50_000_000, available=20 * GB)
    args.update(kw)
    facts = {k: args.pop(k) for k in ("sizes", "expert_bytes", "baseline", "available") if k in args}
    return plan_memory(cfg, MemoryRequest(**args), **facts)


def test_planned_sizes_are_the_released_checkpoints():
    s = sizes_from_config(K3)
    assert s.trunk_bytes == 108_811_877_376  # docs/model.md §9: per-layer families
    assert s.tables_bytes == 4_697_663_488  # embed + lm_head + three vectors, bf16
    assert s.expert_bytes == 17_547_264 and s.n_moe_layers == 92
    assert s.expert_bytes_per_token == 16 * 92 * 17_547_264  # 25.83 GB
    assert s.layer_bytes.index(s.largest_layer) == 0 and round(s.largest_layer / 1e6) == 2341


def test_rows_and_total():
    p = plan()
    labels = [label for label, _ in p.rows()]
    assert labels == ["trunk (STREAMED)", "embed + lm_head", "expert cache", "recurrent state",
                      "buffers", "KV cache", "python + libraries", "TOTAL"]
    assert sum(n for _, n in p.rows()[:-1]) == p.total
    # lm_head + three vectors: the embedding is gathered a row per token id, never loaded
    assert p.trunk == 3 * GB and p.tables == 4_697_663_488 - 163_840 * 7168 * 2
    assert p.cache_slots == 1 * GB // 17_551_360 and p.expert_cache == p.cache_slots * 17_551_360
    assert p.recurrent == 69 * recurrent_bytes_per_layer(K3)
    assert p.kv_cache == 14 * kv_bytes_per_position(K3)
    assert p.baseline == 50_000_000 and p.available == 20 * GB
    assert "memory plan" in p.lines()[0] and "available" in p.lines()[-1]


def test_resident_ultra_and_full_recompute_rows():
    r = plan(streamed=False, trunk_budget=None)
    assert r.rows()[0] == ("trunk (resident)", sizes_from_config(K3).trunk_bytes)
    assert plan(streamed=False, trunk_bytes_resident=123).trunk == 123
    u = plan(ultra=True, incremental=False)
    assert u.rows()[1][0] == "embed + lm_head (STREAMED)" and u.tables < 100_000_000
    assert u.recurrent == recurrent_bytes_per_layer(K3)
    assert u.kv_cache == 14 * kv_bytes_per_position(K3)  # full recompute holds one too
    assert plan(ultra=True, incremental=True).recurrent == 69 * recurrent_bytes_per_layer(K3)
    ultra = plan(trunk_budget=int(2.5 * GB), cache_bytes=int(0.31 * GB), ultra=True,
                 incremental=False)
    # the reference quotes "~3 GB planned"; k3's plan adds what a prompt's visit may read
    # outside the cache's 17 slots (one transient buffer an expert, at most the slots)
    transient = ultra.cache_slots * slot_bytes(EXPERT_BYTES)
    assert ultra.cache_slots == 17
    assert 2.5 * GB < ultra.total - transient < 3.2 * GB


def test_budgets_never_exceed_what_the_model_can_use():
    p = plan(TINY, trunk_budget=110 * GB, cache_bytes=109 * GB)
    s = sizes_from_config(TINY)
    assert p.trunk <= s.trunk_bytes + 4096 * TINY.n_layers and p.notes
    assert p.expert_cache == s.expert_pool_bytes


def test_layers_limit_the_plan():
    p = plan(n_layers=4)
    assert p.recurrent == 3 * recurrent_bytes_per_layer(K3)  # layers 0..2 KDA, 3 MLA
    assert p.kv_cache == kv_bytes(K3, 14, 4) == 14 * kv_bytes_per_position(K3) // 24
    with pytest.raises(UsageError):
        plan(n_layers=0)


def test_check_refuses_with_numbers():
    p = plan(available=6 * GB)
    assert not p.fits()
    with pytest.raises(MemoryPlanError) as exc:
        p.check()
    msg = str(exc.value)
    assert exc.value.exit_code == 1
    assert msg.startswith("REFUSING TO START: this needs ")
    assert f"the machine has {human(6 * GB)} available, a shortfall of " \
           f"{human(p.total - 6 * GB)}" in msg and "Options:" in msg
    plan(available=20 * GB).check()  # fits: no exception


def test_check_counts_the_five_percent_margin():
    p = plan(available=20 * GB)
    edge = plan(available=int(p.total / 0.95) - 1_000)
    assert not edge.fits() and "safety line" in _refusal(edge)
    plan(available=int(p.total / 0.95) + 1_000).check()


def _refusal(p):
    with pytest.raises(MemoryPlanError) as exc:
        p.check()
    return str(exc.value)


def test_the_latent_cache_is_43_times_smaller_than_expanded_heads():
    per = kv_bytes_per_position(K3)
    assert per == 4 * (512 + 64) * 24 == 55_296  # latent + rope key, float32, 24 MLA layers
    assert expanded_kv_bytes_per_position(K3) == 2_365_440  # the reference's 2.37 MB/position
    assert round(expanded_kv_bytes_per_position(K3) / per, 1) == 42.8


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "full"])
def test_every_mode_plans_the_kv_cache(incremental):
    for cfg in (K3, TINY):
        p = plan(cfg, incremental=incremental, trunk_budget=GB)
        assert p.kv_cache == kv_bytes(cfg, 5 + 8 + 1) == 14 * kv_bytes_per_position(cfg) > 0
        assert ("KV cache", p.kv_cache) in p.rows()


def test_kv_refusal_is_a_usage_error():
    per = kv_bytes_per_position(K3)
    assert check_kv(K3, 4096, available=100 * GB) == 4096 * per
    with pytest.raises(UsageError) as exc:
        check_kv(K3, 1_000_000, available=50 * GB)  # 55.3 GB > 45 GB
    msg = str(exc.value)
    assert exc.value.exit_code == 2
    assert "memory limit" in msg and "full recompute included" in msg and "GB" in msg
    assert "a smaller max_tokens" in msg  # the keyword: the command line says --gen
    assert "0.06 MB/position" in msg


def test_negative_request_is_refused():
    with pytest.raises(UsageError):
        plan(gen=-1)
    with pytest.raises(UsageError):
        plan(trunk_budget=None)


def test_baseline_defaults_to_this_process():
    p = plan_memory(TINY, MemoryRequest(streamed=True, trunk_budget=GB, cache_bytes=0,
                                        prompt_len=1, gen=1, incremental=False), available=GB)
    assert 10_000_000 < p.baseline < 4 * GB


def test_human_units():
    assert human(2_370_000) == "2.37 MB" and human(4_697_663_488) == "4.70 GB"
    assert human(1_560_936_091_448) == "1.56 TB" and human(12) == "12 B"
    assert human(1_500) == "1.50 kB" and human(999) == "999 B"


def test_one_expert_size_and_one_slot_formula():
    """The released expert size is derived, and a slot is the expert plus one 4096 unit."""
    assert sizes_from_config(K3).expert_bytes == EXPERT_BYTES == 4284 * ALIGN
    assert slot_bytes(EXPERT_BYTES) == 4285 * ALIGN == align_up(EXPERT_BYTES + ALIGN)
    assert slot_bytes(EXPERT_BYTES + 1) == 4286 * ALIGN and slot_bytes(0) == 0


@pytest.mark.parametrize("cache_gb", [0.3, 1, 16, 64, 123.456789, 1450])
def test_the_plan_counts_the_slots_the_engine_makes(cache_gb):
    """The memory plan and the expert cache divide the same budget by the same stride."""
    engine = expert_slots(K3, K3.n_layers, EXPERT_BYTES, cache_gb)
    p = plan(cache_bytes=gb_bytes(cache_gb))
    assert p.cache_slots == engine and p.expert_cache == engine * slot_bytes(EXPERT_BYTES)
    if cache_gb == 64:
        assert engine == 3646


def test_slots_multiply_the_per_sequence_rows_and_most_slots_fits_them():
    from k3core.run.memory_plan import most_slots

    one = plan(prompt_len=4000, gen=96)
    four = plan(prompt_len=4000, gen=96, slots=4, prefix_cache=3 * 10**8)
    assert four.kv_cache == 4 * one.kv_cache and four.recurrent == 4 * one.recurrent
    assert four.prefix_cache == 3 * 10**8 and four.buffers > one.buffers
    labels = [label for label, _ in four.rows()]
    assert "KV cache (4 slots)" in labels and "recurrent state (4 slots)" in labels
    assert "prefix cache" in labels and sum(n for _, n in four.rows()[:-1]) == four.total
    n = most_slots(one, 10_000)
    assert 1 <= n < 10_000
    assert plan(prompt_len=4000, gen=96, slots=n).fits()
    assert not plan(prompt_len=4000, gen=96, slots=n + 1).fits()
    assert most_slots(one, 3) == 3


def test_a_batch_that_cannot_fit_is_refused_with_its_numbers():
    too_many = plan(prompt_len=4000, gen=96, slots=2000)
    with pytest.raises(MemoryPlanError, match=r"--max-batch") as e:
        too_many.check()
    assert "2000 slots" in str(e.value)
    with pytest.raises(UsageError, match="batch must be at least 1"):
        plan(slots=0)


def test_buffers_count_the_transient_experts_of_one_visit():
    """A prompt's visit reads the experts the policy does not admit into buffers of their
    own: the union of its rows' experts (topk a row), at most a layer's experts and at most
    the cache's slots, all counted in the buffers row."""
    from k3core.run.memory_plan import buffer_bytes

    slot = slot_bytes(sizes_from_config(K3).expert_bytes)
    one = plan(prompt_len=0, gen=0)  # T = 1: one row, its topk experts
    assert one.buffers - buffer_bytes(K3, 1) == min(one.cache_slots, K3.topk) * slot
    big = plan(cache_bytes=100 * GB, prompt_len=200, gen=0)  # 201 rows: every expert of a layer
    assert big.buffers - buffer_bytes(K3, 201) == K3.n_experts * slot
    small = plan(cache_bytes=int(0.2 * GB), prompt_len=200, gen=0)  # the slots bound it
    assert small.buffers - buffer_bytes(K3, 201) == small.cache_slots * slot
