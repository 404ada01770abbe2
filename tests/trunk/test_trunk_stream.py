"""Streaming the trunk: the plan, the ring's invariants, and the same bits at every budget.

Every available storage backend, every budget from the floor (nothing pinned, ring 1 and
ring 2) to everything pinned, incremental and full recompute, plus ultra-low-memory: the
generated ids and the step-0 logits bytes must equal the resident run's.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from k3_storage.plain import PlainStorage
from thin import thinned
from typer.testing import CliRunner

from k3core.api.errors import K3Error, StorageError, UsageError
from k3core.api.read_priority import AHEAD_MAX_WAIT_S, DEMAND
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.shapes import size_config
from k3core.model.sources import ModelTables
from k3core.model.state import SequenceState
from k3core.plugins.registry import get_registry
from k3core.testing.faulty_backend import FaultyStorage, available_storage, disk_backed_dir
from k3core.tools.synth.writer import synthesize
from k3core.trunk.manifest import open_trunk
from k3core.trunk.parts import split_layer
from k3core.trunk.plan import plan_trunk
from k3core.trunk.stream import StreamedTrunk
from k3core.trunk.tables import StreamedTables

runner = CliRunner()
PROMPT = "3,7,11,5"
GEN = "3"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("stream"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 2)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(model), str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def sizes(model, trunk) -> list[int]:
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        return [lay.nbytes for lay in open_trunk(trunk, idx, cfg).layers]


def _run(model: Path, work: Path, tag: str, *extra: str) -> tuple[str, bytes]:
    logits = work / f"logits-{tag}.f32"
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", GEN,
                              "--dump-logits", str(logits), *extra])
    assert res.exit_code == 0, res.output
    ids = next(line for line in res.output.splitlines() if line.startswith("generated ids:"))
    return ids, logits.read_bytes()


@pytest.fixture(scope="module")
def resident(model, work) -> dict[str, tuple[str, bytes]]:
    return {mode: _run(model, work, f"resident-{mode}", *flags)
            for mode, flags in (("full", ("--full-recompute",)), ("incremental", ("--incremental",)))}


@pytest.fixture(scope="module")
def part_sizes(model, trunk) -> list[int]:
    """The sub-layer parts the engine streams (attention, MLP/MoE of each layer)."""
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        return [p.nbytes for lay in open_trunk(trunk, idx, cfg).layers
                for p in split_layer(lay).parts]


def _budgets(sizes: list[int], parts: list[int] | None = None) -> dict[str, float]:
    floor, total = max(sizes), sum(sizes)
    out = {"floor-ring1": floor / 1e9, "floor-ring2": 2 * floor / 1e9,
           "half": (total // 2) / 1e9, "all-pinned": total / 1e9}
    if parts:  # the part floor: one or two slots of the largest part, nothing pinned
        big = max(parts)
        out.update({"part-floor-ring1": big / 1e9, "part-floor-ring2": 2 * big / 1e9,
                    # two unequal slots: the largest part and the next size down
                    "part-unequal": (big + max(n for n in parts if n < big)) / 1e9})
    return out


@pytest.mark.parametrize("storage", thinned(available_storage(), ("direct",)))
@pytest.mark.parametrize("mode", ["full", "incremental"])
def test_same_ids_and_logits_at_every_budget(model, trunk, work, sizes, part_sizes, resident,
                                             storage, mode):
    flags = ("--incremental",) if mode == "incremental" else ("--full-recompute",)
    assert max(part_sizes) < max(sizes)  # the layers split
    for name, gb in _budgets(sizes, part_sizes).items():
        got = _run(model, work, f"{storage}-{mode}-{name}", "--storage", storage, "--trunk",
                   str(trunk), "--trunk-gb", f"{gb:.9f}", *flags)
        assert got[0] == resident[mode][0], (name, got[0])
        assert got[1] == resident[mode][1], f"{name}: step-0 logits differ"


@pytest.mark.parametrize("storage", thinned(available_storage(), ("direct", "mmap")))
def test_ultra_low_memory_is_bit_identical(model, trunk, work, sizes, resident, storage):
    for mode, flags in (("full", ("--full-recompute",)), ("incremental", ("--incremental",))):
        got = _run(model, work, f"ultra-{storage}-{mode}", "--storage", storage, "--trunk",
                   str(trunk), "--trunk-gb", f"{max(sizes) / 1e9:.9f}", "--ultra-low-memory",
                   *flags)
        assert got == resident[mode], mode


def test_run_reports_the_trunk(model, trunk, work, sizes) -> None:
    out = work / "report.json"
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", "2", "--trunk",
                              str(trunk), "--trunk-gb", f"{2 * max(sizes) / 1e9:.9f}",
                              "--ultra-low-memory", "--full-recompute", "--out", str(out)])
    assert res.exit_code == 0, res.output
    for text in ("trunk on disk", "trunk plan    : 0/13 layers PINNED", "ring 2 x",
                 "stream units  : 26 parts", "trunk [final]: pinned 0/13 layers (",
                 "binds 52, hits ",
                 "overlapped compute", "model tables (STREAMED)", "exposed waits : trunk ",
                 "recurrent state: one slot, cleared and reused across 13 layers"):
        assert text in res.output, text
    import json

    doc = json.loads(out.read_text())
    assert doc["trunk_ring_bytes_read"] >= 26 * min(sizes)
    assert doc["trunk_binds"] == 52 and doc["ultra_low_memory"]
    assert doc["trunk_hits"] == 2 * doc["trunk_pinned_units"]  # two steps
    assert doc["trunk_units"] == 26 and len(doc["trunk_plan"]["units"]) == 26
    assert doc["trunk_plan"]["units"][:2] == ["0.attn", "0.mlp"]
    assert len(doc["trunk_plan"]["pinned_units"]) == doc["trunk_pinned_units"]
    assert doc["embedding_bytes_read"] > 0 and doc["lm_head_bytes_read"] > 0
    assert len(doc["step_seconds"]) == 2


# ---- the plan ------------------------------------------------------------------------------
def test_plan_examples() -> None:
    p = plan_trunk([10, 5, 5, 5, 5, 5], 20, ring=2)
    assert (p.pinned, p.ring, p.slot_bytes) == ((), 2, 10)
    p = plan_trunk([10, 5, 5, 5, 5, 5], 25, ring=2)
    assert (p.pinned, p.ring, p.slot_bytes) == ((1,), 2, 10)
    p = plan_trunk([10, 5, 5, 5, 5, 5], 30, ring=2)  # pinning layer 0 shrinks the slot to 5
    assert (p.pinned, p.ring, p.slot_bytes, p.planned_bytes) == ((0, 1, 2), 2, 5, 30)
    p = plan_trunk([10, 5, 5, 5, 5, 5], 15, ring=2)  # a second slot only if it fits
    assert (p.pinned, p.ring, p.slot_bytes) == ((1,), 1, 10) and p.ring_held_short
    p = plan_trunk([10, 5, 5, 5, 5, 5], 30, ring=8)
    assert p.ring == 3 and p.pinned == ()
    p = plan_trunk([10, 5, 5, 5, 5, 5], 35, ring=2)
    assert (p.pinned, p.ring, p.slot_bytes) == ((0, 1, 2, 3, 4, 5), 0, 0)
    with pytest.raises(UsageError, match=r"below the floor.*needs 10 B"):
        plan_trunk([10, 5, 5, 5, 5, 5], 9)
    with pytest.raises(UsageError, match="1..8"):
        plan_trunk([10, 5], 100, ring=9)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(0, 700),
       st.integers(1, 8))
def test_plan_always_fits_and_covers(sizes, budget, ring) -> None:
    sizes = [s * 4096 for s in sizes]
    budget *= 4096
    if budget < max(sizes):
        with pytest.raises(UsageError):
            plan_trunk(sizes, budget, ring)
        return
    p = plan_trunk(sizes, budget, ring)
    assert p.planned_bytes <= budget
    streamed = p.streamed
    assert all(sizes[i] <= p.slot_bytes for i in streamed)
    assert (p.ring >= 1) == bool(streamed) and p.ring <= min(ring, len(streamed))


# ---- the ring's invariants (driven directly, reads observed through FaultyStorage) ------------
def _open(model: Path, trunk: Path, budget: int, ring: int, faulty: FaultyStorage):
    cfg = load_config(model / "config.json")
    idx = CheckpointIndex.open(model, PlainStorage())
    man = open_trunk(trunk, idx, cfg)
    return cfg, idx, man, StreamedTrunk(cfg, man, faulty, budget, ring=ring)


def _assert_bytes(idx: CheckpointIndex, params, layer: int) -> None:
    w = params["self_attn.o_proj.weight"] if "self_attn.o_proj.weight" in params.t else None
    assert w is not None
    assert np.asarray(w).tobytes() == idx.read(names.layer_name(layer, "self_attn.o_proj.weight")).tobytes()
    assert not w.flags.writeable  # a zero-copy view into the slot


def _wait(cond, timeout=5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)


def test_slot_being_read_is_never_handed_out(model, trunk, sizes) -> None:
    faulty = FaultyStorage(PlainStorage())
    cfg, idx, man, _ = _open(model, trunk, sum(sizes), 2, faulty)  # just for the manifest
    _.close()
    gate = threading.Event()
    faulty.gates[man.layers[1].file_off] = gate
    cfg, idx, man, tr = _open(model, trunk, 2 * max(sizes), 2, faulty)
    try:
        assert tr.has_reader and tr.pinned_layers == ()
        p0 = tr.acquire(0)
        _assert_bytes(idx, p0, 0)
        tr.release(0)
        got: list = []
        t = threading.Thread(target=lambda: got.append(tr.acquire(1)))
        t.start()
        time.sleep(0.2)
        assert t.is_alive() and not got
        assert (1, "reading") in tr.slot_states()
        gate.set()
        t.join(5)
        _assert_bytes(idx, got[0], 1)
        tr.release(1)
    finally:
        gate.set()
        tr.close()
        idx.close()


def test_held_slot_is_never_evicted(model, trunk, sizes) -> None:
    faulty = FaultyStorage(PlainStorage())
    cfg, idx, man, tr = _open(model, trunk, 2 * max(sizes), 2, faulty)
    try:
        p0 = tr.acquire(0)
        p1 = tr.acquire(1)  # both slots held: layer 2 is wanted but has nowhere to go
        time.sleep(0.2)
        assert sorted(s for s, _ in tr.slot_states()) == [0, 1]
        assert all(off != man.layers[2].file_off for _, off, _ in faulty.log)
        _assert_bytes(idx, p0, 0)
        tr.release(0)
        _wait(lambda: (2, "ready") in tr.slot_states())
        _assert_bytes(idx, p1, 1)
        tr.release(1)
    finally:
        tr.close()
        idx.close()


@pytest.mark.parametrize("ring", [2, 3, 5])
def test_wanted_layers_are_not_evicted_so_nothing_is_read_twice(model, trunk, sizes, ring) -> None:
    faulty = FaultyStorage(PlainStorage())
    cfg, idx, man, tr = _open(model, trunk, ring * max(sizes), ring, faulty)
    try:
        passes = 4
        for _ in range(passes):
            for L in range(cfg.n_layers):
                tr.acquire(L)
                time.sleep(0.001)  # "compute": lets the reader run ahead
                tr.release(L)
        # the walk is past the last part, so the ring's window has moved on to the next
        # pass: the reader reads its first `ring` parts, and then nothing more
        first = [L for L in range(cfg.n_layers) if L not in tr.pinned_layers][: tr.plan.ring]
        _wait(lambda: sorted(L for L, s in tr.slot_states() if s == "ready") == first)
        time.sleep(0.05)
        streamed = cfg.n_layers - len(tr.pinned_layers)
        reads = [off for name, off, _ in faulty.log if name == "trunk.bin"]
        pinned_reads = len(tr.pinned_layers)
        assert len(reads) - pinned_reads == streamed * passes + tr.plan.ring
        assert tr.stats.binds == passes * cfg.n_layers
        assert tr.stats.hits == passes * len(tr.pinned_layers)
    finally:
        tr.close()
        idx.close()


@pytest.mark.parametrize("ring", [1, 2])
def test_failed_read_is_raised_and_never_served(model, trunk, sizes, ring) -> None:
    faulty = FaultyStorage(PlainStorage())
    cfg, idx, man, tr = _open(model, trunk, ring * max(sizes), ring, faulty)
    faulty.fail_offsets.add(man.layers[5].file_off)
    try:
        for L in range(5):
            tr.acquire(L)
            tr.release(L)
        with pytest.raises(StorageError, match="trunk layer 5: .*injected read failure"):
            tr.acquire(5)
        assert tr.held_layers() == [] and tr.stats.failed_reads >= 1
        assert all(s != 5 for s, _ in tr.slot_states())
        faulty.fail_offsets.clear()  # the device recovers: the layer is read again, whole
        p5 = tr.acquire(5)
        _assert_bytes(idx, p5, 5)
        tr.release(5)
    finally:
        tr.close()
        idx.close()


def test_one_slot_has_no_reader_and_never_reads_over_the_slot_in_use(model, trunk, sizes) -> None:
    faulty = FaultyStorage(PlainStorage())
    cfg, idx, man, tr = _open(model, trunk, max(sizes), 2, faulty)
    try:
        assert tr.plan.ring == 1 and not tr.has_reader
        time.sleep(0.05)
        assert not any(name == "trunk.bin" for name, _, _ in faulty.log)  # nothing read ahead
        p0 = tr.acquire(0)
        with pytest.raises(K3Error, match="no free ring slot"):
            tr.acquire(1)
        _assert_bytes(idx, p0, 0)
        tr.release(0)
        _assert_bytes(idx, tr.acquire(1), 1)
        tr.release(1)
    finally:
        tr.close()
        idx.close()


def test_pinned_layers_are_read_once_and_close_stops_the_reader(model, trunk, sizes) -> None:
    faulty = FaultyStorage(PlainStorage())
    budget = sum(sizes) - min(sizes)
    cfg, idx, man, tr = _open(model, trunk, budget, 2, faulty)
    try:
        pinned = tr.pinned_layers
        assert len(pinned) >= 6
        for _ in range(3):
            for L in range(cfg.n_layers):
                _assert_bytes(idx, tr.acquire(L), L)
                tr.release(L)
        pinned_offs = {man.layers[L].file_off for L in pinned}
        reads = [off for name, off, _ in faulty.log if name == "trunk.bin" and off in pinned_offs]
        assert sorted(reads) == sorted(pinned_offs)
        assert tr.stats.pin_bytes == sum(sizes[L] for L in pinned)
    finally:
        threads = tr.threads
        tr.close()
        idx.close()
    assert not any(t.is_alive() for t in threads)


# ---- ultra-low-memory parts ----------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 1000, 130_000, 64 << 20])
def test_streamed_tables_match_resident_bits(model, numpy_backend, chunk) -> None:
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        res, stream = ModelTables(cfg, idx), StreamedTables(cfg, idx, chunk_bytes=chunk)
        ids = np.array([0, 5, 1023, 5, 77])
        assert stream.embed(ids).tobytes() == res.embed(ids).tobytes()
        x = np.random.default_rng(0).standard_normal((3, cfg.hidden), dtype=np.float32)
        assert stream.logits(numpy_backend, x).tobytes() == res.logits(numpy_backend, x).tobytes()
        assert stream.stats.lm_head_bytes_read == idx.info(names.LM_HEAD).nbytes
        assert stream.stats.embedding_bytes_read == 5 * cfg.hidden * 2


def test_shared_kda_slot_is_full_recompute_only(model) -> None:
    cfg = load_config(model / "config.json")
    st_ = SequenceState(cfg, 8, shared_kda_slot=True)
    a = st_.kda_state(1)
    a.S[...] = 1.0
    assert st_.kda_state(1).S.max() == 1.0  # same layer: kept
    b = st_.kda_state(2)
    assert b is a and not b.S.any()  # next layer: the same slot, cleared
    st_.pos = 4
    with pytest.raises(K3Error, match="incremental decoding needs one slot per layer"):
        st_.kda_state(1)


def test_registry_create_storage_is_what_the_engine_uses(model, trunk) -> None:
    names_ = available_storage()
    assert "plain" in names_
    backend, _, _ = get_registry().create("storage", "plain")
    assert backend.name == "plain"


@pytest.fixture(scope="module")
def coded_trunk(model, work) -> Path:
    out = work / "trunk-bp-nib"
    res = runner.invoke(app, ["pack-trunk", str(model), str(out), "--codec", "bp-nib"])
    assert res.exit_code == 0, res.output
    return out


@pytest.mark.parametrize("packed", ["raw", "bp-nib"])
def test_ring_reads_yield_to_demand_reads_and_serve_the_same_bytes(model, trunk, coded_trunk,
                                                                   packed) -> None:
    """The ring's reader reads a raw part's pieces, or a coded part's chunks, after the
    expert reads in flight (beside the last one only), and still serves every layer byte
    for byte."""
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        man = open_trunk(trunk if packed == "raw" else coded_trunk, idx, cfg)
        ring = 2 * max(lay.nbytes for lay in man.layers)
        faulty = FaultyStorage(PlainStorage())
        before = DEMAND.waited_seconds
        DEMAND.begin()  # expert reads in flight while the reader starts filling the ring
        DEMAND.begin()
        try:
            tr = StreamedTrunk(cfg, man, faulty, ring, ring=2)
            try:
                time.sleep(3 * AHEAD_MAX_WAIT_S)
                assert DEMAND.waited_seconds - before >= 0.9 * AHEAD_MAX_WAIT_S
            finally:
                DEMAND.end()
                DEMAND.end()
            for layer in range(cfg.n_layers):  # the walk still gets every layer, byte for byte
                p = tr.acquire(layer)
                want = idx.read(names.layer_name(layer, "self_attn.o_proj.weight")).tobytes()
                assert p["self_attn.o_proj.weight"].tobytes() == want
                tr.release(layer)
            tr.close()
        finally:
            assert DEMAND.active == 0


def test_expert_miss_reads_are_counted_in_and_out(model, trunk, work) -> None:
    out = work / "run.json"
    res = runner.invoke(app, ["run", str(model), "--ids", "3,7,11", "--gen", "3", "--trunk",
                              str(trunk), "--trunk-gb", "0.0003", "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["expert_bytes_read"] > 0 and report["trunk_ring_bytes_read"] > 0
    assert DEMAND.active == 0  # every miss read's future ended its demand
