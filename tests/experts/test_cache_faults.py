"""Routed-expert reads that fail: a read error or a shard truncated after it was opened fails
the forward pass with exit 4 and a message naming the expert, never a traceback or an output
file, and the failed slot is never served or counted as a hit afterwards (the fault injector
scribbles 0xA5 over the destination before failing, so serving it would show)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.api.cache_policy import make_key
from k3core.api.errors import ExpertDropError
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import slot_bytes as slot_stride
from k3core.testing.disk import disk_tmpdir
from k3core.testing.expert_cache_conformance import (
    FIXTURE_SHARD,
    Rig,
    ShardTruth,
    cache_fixture,
    drive,
    fixture_cache,
    make_storage,
    model_cache,
    scatter_experts,
)
from k3core.testing.faults import SCRIBBLE, FaultInjector
from k3core.testing.faulty_backend import available_storage, env, register_faulty, unregister_faulty
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
STORAGES = available_storage()
PROMPT = "3,7,11,5,9"


@pytest.fixture(scope="module")
def work():
    with disk_tmpdir("k3-cache-faults-") as d:
        yield d


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 32, "num_experts_per_token": 4}))
    return synthesize(work / "tiny32", cfg, 2)


def expert_start(truth: ShardTruth, layer: int, expert: int) -> tuple[Path, int, int]:
    """``(shard, first byte, one past the last byte)`` of an expert's six tensors."""
    spans = [truth.where[names.expert_name(layer, expert, p, f)]
             for p in names.EXPERT_PARTS for f in ("weight_packed", "weight_scale")]
    return spans[0][0], min(s[1] for s in spans), max(s[1] + s[2] for s in spans)


def slot_bytes(rig: Rig, slot: int, layer: int, expert: int) -> np.ndarray:
    """The bytes of ``slot`` where ``expert`` of ``layer`` sits (its file offset's remainder)."""
    c = rig.cache
    ref = c.locator.ref(layer, expert)
    start = slot * c.stride + (ref.offset % 4096 if ref.contiguous else 0)
    return c.arena[start : start + ref.nbytes]


# ---- the cache itself ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lru", "cycle-eta"])
@pytest.mark.parametrize("storage", STORAGES)
def test_failed_read_is_dropped_and_never_served(work: Path, storage: str, policy: str) -> None:
    truth = ShardTruth(cache_fixture(work / "truth"))
    _, lo, _ = expert_start(truth, 0, 7)
    faulty = FaultInjector(make_storage(storage), fail_range=(lo, lo + 1))
    rig = fixture_cache(work / f"fx-{storage}-{policy}", faulty, policy, 5)
    try:
        with pytest.raises(ExpertDropError, match=r"routed expert 0/7 could not be read") as err:
            drive(rig, [[(0, [3, 7, 9, 1])]])
        assert "injected fault" in str(err.value) and len(faulty.injected) == 1
        c = rig.cache
        assert c.stats.drops == 1 and make_key(0, 7) not in c.slot_of
        # experts are used as their reads complete, so some of the batch may have been
        # multiplied before the failure surfaced; the failed one never is, and the visit
        # raises, so the forward pass never forms the partial sum
        assert all(e != 7 for _, _, e in rig.served), "a failed read never reaches the MoE"
        assert {e for _, _, e in rig.served} <= {3, 9, 1}
        freed = c.free[-1]  # the failed read's slot went back EMPTY ...
        assert c.key_of[freed] is None
        assert (slot_bytes(rig, freed, 0, 7) == SCRIBBLE).all()  # ... holding the scribbled bytes
        # the others of the batch completed and stay resident with exact bytes
        assert {make_key(0, e) for e in (3, 9, 1)} <= set(c.slot_of)
        faulty.heal()
        misses, hits = c.stats.misses, c.stats.hits
        before = len(rig.served)
        drive(rig, [[(0, [7, 3])]])  # checks every served byte against the shard
        assert c.stats.misses == misses + 1, "the failed expert must be read again, not hit"
        assert c.stats.hits == hits + 1  # 3 was published before the failure
        assert sorted(e for _, _, e in rig.served[before:]) == [3, 7]
    finally:
        rig.close()


@pytest.mark.parametrize("storage", STORAGES)
def test_one_failed_tensor_of_a_scattered_expert(work: Path, model: Path, storage: str) -> None:
    scattered = work / "scattered"
    if not scattered.exists():
        scatter_experts(model, scattered)
    truth = ShardTruth(scattered)
    shard, off, n, _ = truth.where[names.expert_name(2, 5, "w3", "weight_scale")]
    faulty = FaultInjector(make_storage(storage), fail_range=(off, off + n), path_contains=shard.name)
    rig = model_cache(scattered, faulty, "lru", 5)
    try:
        assert not rig.cache.locator.ref(2, 5).contiguous
        with pytest.raises(ExpertDropError, match="routed expert 2/5"):
            drive(rig, [[(1, [0, 1, 2, 3]), (2, [5, 6, 7, 8])]])
        assert make_key(2, 5) not in rig.cache.slot_of
        # experts are used as their reads complete: others of layer 2 may have been, the
        # failed one never is (and the visit raised, so no MoE sum was formed)
        assert all(L == 1 or e in (6, 7, 8) for _, L, e in rig.served)
        faulty.heal()
        drive(rig, [[(2, [5, 6])]])
    finally:
        rig.close()


@pytest.mark.parametrize("storage", STORAGES)
def test_shard_truncated_after_open(work: Path, storage: str) -> None:
    d = work / f"trunc-{storage}"
    rig = fixture_cache(d, make_storage(storage), "lru", 6)  # its own copy of the shard
    try:
        drive(rig, [[(0, [1, 2, 3, 4])]])
        shard = d / "cache-fixture" / FIXTURE_SHARD
        _, lo, _ = expert_start(rig.truth, 0, 20)
        os.truncate(shard, lo + 100)  # expert 20 loses all but 100 bytes; 21..23 are gone
        with pytest.raises(ExpertDropError, match="routed expert 0/2[0-3]") as err:
            drive(rig, [[(0, [2, 20, 22])]], check=False)
        assert rig.cache.stats.drops >= 1 and "Traceback" not in str(err.value)
        assert not {make_key(0, e) for e in (20, 21, 22, 23)} & set(rig.cache.slot_of)
        assert all(e < 20 for _, _, e in rig.served)
        drive(rig, [[(0, [2, 5])]])  # what is still there is served exactly
    finally:
        rig.close()


# ---- through k3 run --------------------------------------------------------------------------
@pytest.fixture
def faulty_cli():
    register_faulty()
    yield
    unregister_faulty()


def first_request(model: Path, work: Path) -> tuple[int, int]:
    trace_dir = work / "first-trace"
    if not (trace_dir / "expert_trace.bin").exists():
        trace_dir.mkdir(exist_ok=True)
        res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", "0",
                                  "--dump-cache-trace", str(trace_dir)])
        assert res.exit_code == 0, res.output
    layer, expert = np.fromfile(trace_dir / "expert_trace.bin", dtype="<i4")[:2]
    return int(layer), int(expert)


def assert_clean_exit_4(res, outputs: list[Path], layer: int) -> None:
    assert res.exit_code == 4, res.output
    assert f"routed expert {layer}/" in res.output and "could not be read" in res.output
    assert res.output.count("k3: error:") == 1
    assert "Traceback" not in res.output and "generated ids" not in res.output
    for p in outputs:
        assert not p.exists(), f"{p} was written by a failed run"


@pytest.mark.parametrize("inner", STORAGES)
def test_run_with_a_failing_expert_read_exits_4(model, work, monkeypatch, faulty_cli, inner) -> None:
    layer, expert = first_request(model, work)
    shard, lo, _ = expert_start(ShardTruth(model), layer, expert)
    for k, v in env(inner=inner, match=shard.name, offsets=lo).items():
        monkeypatch.setenv(k, v)
    outs = [work / f"never-{inner}.json", work / f"never-{inner}.logits", work / f"trace-{inner}"]
    outs[2].mkdir()
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", "2", "--storage", "faulty",
                              "--cache-gb", f"{(5 * slot_stride(6528) + 1) / 1e9:.9f}", "--out", str(outs[0]), "--dump-logits", str(outs[1]),
                              "--dump-cache-trace", str(outs[2])])
    assert_clean_exit_4(res, outs[:2] + [outs[2] / "expert_trace.bin"], layer)
    assert f"routed expert {layer}/{expert} could not be read" in res.output
    assert "injected read failure" in res.output


def test_run_with_a_shard_truncated_after_open_exits_4(model, work, monkeypatch) -> None:
    layer, expert = first_request(model, work)
    victim = work / "truncated-model"
    shutil.copytree(model, victim)
    truth = ShardTruth(victim)
    shard, lo, _ = expert_start(truth, layer, expert)
    # everything from this expert on in its shard is routed experts: the trunk stays intact
    assert all(".experts." in name for name, (p, off, _, _) in truth.where.items() if p == shard and off >= lo)
    orig = CheckpointIndex.open.__func__  # type: ignore[attr-defined]

    def open_then_truncate(cls, model_dir, storage):
        index = orig(cls, model_dir, storage)
        if Path(model_dir) == victim:
            os.truncate(shard, lo + 64)
        return index

    monkeypatch.setattr(CheckpointIndex, "open", classmethod(open_then_truncate))
    out = work / "never-truncated.json"
    res = runner.invoke(app, ["run", str(victim), "--ids", PROMPT, "--gen", "2", "--storage", "mmap",
                              "--out", str(out)])
    assert_clean_exit_4(res, [out], layer)
    assert "shrank" in res.output or "short" in res.output or "end of file" in res.output


@pytest.mark.parametrize("storage", STORAGES[:1])
def test_an_expert_is_used_as_soon_as_its_read_completes(work: Path, storage: str) -> None:
    """While one expert's read is held, an expert whose read completed is already multiplied."""
    import threading

    from k3core.testing.faulty_backend import FaultyStorage

    truth = ShardTruth(cache_fixture(work / "truth"))
    shard, lo, _ = expert_start(truth, 0, 9)
    faulty = FaultyStorage(make_storage(storage), match=shard.name)
    gate = threading.Event()
    faulty.gates[lo] = gate
    rig = fixture_cache(work / f"asap-{storage}", faulty, "lru", 5)
    used: list[int] = []
    early = threading.Event()

    def use(e: int, w: object) -> None:
        used.append(e)
        if e == 3 and not gate.is_set():
            early.set()

    try:
        rig.cache.begin_step()
        t = threading.Thread(target=rig.cache.run_layer, args=(0, [9, 3], use), daemon=True)
        t.start()
        assert early.wait(10), "expert 3 waited for expert 9's read"
        assert used == [3]
        gate.set()
        t.join(10)
        assert not t.is_alive() and sorted(used) == [3, 9]
    finally:
        gate.set()
        rig.close()
