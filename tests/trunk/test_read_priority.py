"""Demand reads first (k3core/api/read_priority.py): the gate itself, the trunk ring's reader
yielding to it with the same bytes, and the expert cache counting its miss reads in and out."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.api.read_priority import AHEAD_MAX_WAIT_S, DEMAND, ReadPriority
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.shapes import size_config
from k3core.testing.faulty_backend import FaultyStorage, disk_backed_dir
from k3core.tools.synth.writer import synthesize
from k3core.trunk.manifest import open_trunk
from k3core.trunk.stream import StreamedTrunk

runner = CliRunner()


def test_no_demand_read_means_no_wait() -> None:
    gate = ReadPriority()
    assert gate.active == 0
    assert gate.wait_for_demand(1.0) == 0.0
    assert gate.waited_seconds == 0.0


def test_read_ahead_waits_until_the_demand_reads_are_done() -> None:
    gate = ReadPriority()
    gate.begin()
    with gate.demand():
        assert gate.active == 2
        threading.Timer(0.1, gate.end).start()
        waited: list[float] = []
        t = threading.Thread(target=lambda: waited.append(gate.wait_for_demand(5.0)))
        t.start()
        time.sleep(0.2)
        assert t.is_alive()  # one demand read is still in flight
    t.join(5)
    assert not t.is_alive() and 0.15 <= waited[0] < 4.0
    assert gate.active == 0


def test_read_ahead_never_waits_past_its_timeout() -> None:
    gate = ReadPriority()
    gate.begin()  # a demand read that never ends (stuck in the kernel, say)
    t0 = time.perf_counter()
    waited = gate.wait_for_demand(0.05)
    assert 0.04 <= waited <= time.perf_counter() - t0 < 2.0
    gate.end()
    gate.end()  # an extra end never drives the count below zero
    assert gate.active == 0


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("priority"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 3)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(model), str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_ring_reads_yield_to_demand_reads_and_serve_the_same_bytes(model, trunk) -> None:
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        man = open_trunk(trunk, idx, cfg)
        ring = 2 * max(lay.nbytes for lay in man.layers)
        faulty = FaultyStorage(PlainStorage())
        before = DEMAND.waited_seconds
        DEMAND.begin()  # an expert read in flight while the reader starts filling the ring
        try:
            tr = StreamedTrunk(cfg, man, faulty, ring, ring=2)
            try:
                time.sleep(3 * AHEAD_MAX_WAIT_S)
                assert DEMAND.waited_seconds - before >= 0.9 * AHEAD_MAX_WAIT_S
            finally:
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
