"""``k3 doctor`` is honest about the disk: room for the checkpoint and the trunk, what each
preset's streaming needs from the measured bandwidth, progress on stderr, an announced
scratch file, and ``--json``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import k3core.tools.doctor.machine as machine
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.presets import SHIPPED, load_preset
from k3core.tools.doctor.machine import GIB, run_doctor
from k3core.tools.doctor.needs import (
    checkpoint_bytes,
    packed_trunk_bytes,
    preset_reads,
    released_sizes,
)
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
MEASURE = [("O_DIRECT", 16, 2000.0), ("buffered", 1, 700.0)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("needs") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 5)


@pytest.fixture(autouse=True)
def no_user_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CONFIG_DIR", str(tmp_path / "cfg"))


def checks(r):
    return {c.name: c for c in r.checks}


def test_released_sizes_are_kimi_k3s():
    sz = released_sizes()
    assert sz.trunk_bytes == 108_811_877_376
    assert 1.55e12 < checkpoint_bytes(sz) < 1.57e12
    assert packed_trunk_bytes(sz) >= sz.trunk_bytes


def test_server_pins_all_93_layers_and_its_notes_say_so():
    p = load_preset("server")
    reads = preset_reads(p, released_sizes())
    assert (reads.pinned_layers, reads.n_layers, reads.trunk_bytes) == (93, 93, 0)
    assert "90 of 93" not in p.notes + p.description and "93" in p.notes


def test_preset_notes_attribute_the_reference_measurements():
    for name in SHIPPED:
        p = load_preset(name)
        if "s/token" in p.notes or "peak RSS" in p.notes:
            assert "reference engine" in p.notes or "planned" in p.notes, name


@pytest.mark.parametrize("free, status", [(10 * GIB, "warn"), (1 << 50, "ok")])
def test_room_for_kimi_k3_without_a_model(monkeypatch, tmp_path, free, status):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(machine, "_free", lambda where: free)
    r = run_doctor(None, disk_probe=False, available=64 * GIB, total=64 * GIB)
    c = checks(r)["room for Kimi K3"]
    assert c.status == status and "1.56 TB" in c.detail and "108.81 GB" in c.detail


def test_room_for_the_trunk_with_a_model(monkeypatch, model):
    monkeypatch.setattr(machine, "_free", lambda where: 1000)
    # memory for the tiny model's presets, not for all of it resident: it streams
    r = run_doctor(model, disk_probe=False, available=60_000_000, total=120_000_000,
                   baseline=40_000_000)
    c = checks(r)["room for the trunk"]
    assert c.status == "warn" and str(model.parent) in c.detail
    assert "warning(s) above" in _render(r)
    # all of it fits resident: no trunk to pack, so no room needed for one
    r = run_doctor(model, disk_probe=False, available=64 * GIB, total=64 * GIB)
    assert "room for the trunk" not in checks(r)


def _render(r):
    import io

    from rich.console import Console

    from k3core.cli.doctor import render

    buf = io.StringIO()
    render(r, Console(file=buf, soft_wrap=True, highlight=False))
    return buf.getvalue()


@pytest.mark.parametrize("available", [64 * GIB, 256 * GIB])
def test_each_preset_is_rated_against_the_bandwidth_and_the_memory(model, available):
    """ok only with the memory AND the speed; a preset that does not fit is never ok."""
    r = run_doctor(None, measure=lambda p: MEASURE, available=available, total=available)
    c = checks(r)
    assert r.verdict is not None
    for name in SHIPPED:
        need = preset_reads(load_preset(name), released_sizes())
        detail = c[f"preset {name}"].detail
        assert f">= {need.seconds_at(2000.0):.1f} s/token" in detail and "2,000 MB/s" in detail
        fits = r.verdict.preset_verdict(name).fits_memory
        assert c[f"preset {name}"].status == ("info" if not fits else
                                              "warn" if need.seconds_at(2000.0) > 60 else "ok")
    assert c["preset laptop"].status == "warn"  # fits, but slow
    assert c["preset server"].status == ("info" if available == 64 * GIB else "ok")
    assert r.preset == ("desktop" if available == 64 * GIB else "server")
    rm = run_doctor(model, measure=lambda p: MEASURE, available=60_000_000,
                    total=120_000_000, baseline=40_000_000)
    assert "this model reads" in checks(rm)["preset laptop"].detail


def test_progress_and_the_scratch_file_are_announced(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    probe_dir = tmp_path / "scratch"
    probe_dir.mkdir()
    said, seen = [], []

    def measure(path):
        seen.append(path)
        return MEASURE

    run_doctor(None, measure=measure, probe_bytes=1 << 16, probe_dir=probe_dir,
               progress=said.append, available=8 * GIB, total=8 * GIB)
    assert seen and seen[0].parent == probe_dir
    assert any("scratch file" in m and str(probe_dir) in m for m in said)
    assert any("probing read bandwidth" in m for m in said)
    assert list(probe_dir.iterdir()) == [] and list(tmp_path.iterdir()) == [probe_dir]


def test_cli_progress_goes_to_stderr_and_json_to_stdout(model, tmp_path):
    res = runner.invoke(app, ["doctor", str(model), "--probe-mb", "1", "--json"])
    assert res.exit_code == 0
    out = res.stdout if hasattr(res, "stdout") else res.output
    doc = json.loads(out[out.index("{"):])
    assert doc["result"] == "ready" and doc["next_commands"]
    assert {"section", "name", "status", "detail"} <= set(doc["checks"][0])
    assert "k3 doctor: checking the model directory" in res.output
    bad = runner.invoke(app, ["doctor", "--probe-dir", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "--probe-dir" in bad.output


def test_presets_json():
    res = runner.invoke(app, ["presets", "--json"])
    assert res.exit_code == 0
    doc = json.loads(res.output)
    assert [p["name"] for p in doc["presets"]] == list(SHIPPED)
    assert doc["presets"][1]["trunk_gb"] == 3.0 and doc["skipped"] == []
