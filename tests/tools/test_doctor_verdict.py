"""``k3 doctor``'s verdicts agree with each other and with the model's size.

The verdict logic is one pure function of the machine's facts and the model's
(:func:`k3core.tools.doctor.verdict.judge`), tested here on several machines for Kimi K3's
released figures, the 8 MB demo model and a synthetic model; then the real CLI on this
machine, whose report must be consistent line by line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.memory_plan import PLAN_LIMIT
from k3core.run.presets import list_presets
from k3core.tools.doctor.machine import GIB, model_facts, run_doctor
from k3core.tools.doctor.model import check_model
from k3core.tools.doctor.needs import SLOW_SECONDS_PER_TOKEN
from k3core.tools.doctor.verdict import (
    LADDER,
    RESIDENT_SHARE,
    MachineFacts,
    ModelFacts,
    Verdict,
    judge,
)
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
DEMO = Path(__file__).resolve().parents[2] / "demo-model"
GB = 10**9
MB = 10**6
BASE = 100 * MB  # the interpreter's resident set the plans count


@pytest.fixture(autouse=True)
def no_user_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CONFIG_DIR", str(tmp_path / "cfg"))


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("verdict") / "small",
                      ModelConfig.from_json_dict(size_config("small")), 3)


def facts_of(model_dir: Path) -> ModelFacts:
    from k3_storage.plain import PlainStorage

    return model_facts(check_model(model_dir, PlainStorage()))


def machine(available: float, mb_s: float = 2000.0) -> MachineFacts:
    return MachineFacts(int(available * 1.05), int(available), mb_s, BASE)


def assert_consistent(v: Verdict) -> None:
    """The rules every report keeps, whatever the machine and the model."""
    for p in v.presets:
        if p.fits_memory:
            assert p.planned <= PLAN_LIMIT * v.available
        if p.status == "ok":  # ok only with the memory AND the disk speed
            assert p.fits_memory and p.seconds_per_token is not None
            assert p.seconds_per_token <= SLOW_SECONDS_PER_TOKEN
        if not p.fits_memory:
            assert p.status == "info" and "does not fit" in p.detail
    fitting = [p.name for p in v.presets if p.fits_memory]
    if v.resident:
        assert v.preset is None and v.resident_planned <= RESIDENT_SHARE * v.available
        assert v.memory_status == "ok" and "no packed trunk or preset needed" in v.memory_detail
        return
    if v.preset is None:
        assert not any(n in fitting for n in (*LADDER, "ultra"))
        assert v.memory_status == "warn"
        return
    assert v.preset in fitting and f"--preset {v.preset}" in v.memory_detail
    if v.preset in LADDER:  # the largest of the ladder that fits
        above = LADDER[:LADDER.index(v.preset)]
        assert not any(n in fitting for n in above)
        assert v.memory_status == "ok"
    else:
        assert v.preset == "ultra" and not any(n in fitting for n in LADDER)
        assert v.memory_status == "warn"


@pytest.mark.parametrize("available, preset", [
    (2 * GB, None),  # not even ultra
    (4 * GIB, "ultra"),
    (25 * GB, "laptop"),  # the machine of the issue: workstation and server are not ok
    (64 * GIB, "desktop"),
    (110 * GB, "workstation"),
    (200 * GB, "server"),
    (260 * GB, "server"),  # max fits too, but is never faster than server
])
def test_kimi_k3_on_several_machines(available: float, preset: str | None) -> None:
    v = judge(machine(available), model_facts(None), list_presets())
    assert_consistent(v)
    assert not v.resident and v.preset == preset
    rated = {p.name: p for p in v.presets}
    if available == 25 * GB:
        for name in ("desktop", "workstation", "server", "max"):
            assert rated[name].status == "info" and not rated[name].fits_memory
        assert rated["laptop"].fits_memory and rated["laptop"].status == "warn"  # slow
    if available == 260 * GB:
        assert rated["max"].fits_memory


def test_the_speed_verdict_needs_a_measurement() -> None:
    v = judge(machine(260 * GB, mb_s=0.0), model_facts(None), list_presets())
    assert_consistent(v)
    assert v.preset == "server"
    server = next(p for p in v.presets if p.name == "server")
    # server pins the whole trunk but still reads experts: unmeasured, it is not "ok"
    assert server.status == "info" and "read speed not measured" in server.detail
    slow = judge(machine(260 * GB, mb_s=50.0), model_facts(None), list_presets())
    assert all(p.status != "ok" for p in slow.presets)


@pytest.mark.parametrize("available, resident, preset", [
    (24 * GB, True, None),  # the whole 8 MB model fits: no trunk, no preset
    (300 * MB, True, None),
    (150 * MB, False, "server"),  # not comfortably: every preset, cut to the model, fits
    (20 * MB, False, None),  # below even the floor
])
def test_the_demo_model_on_several_machines(available: float, resident: bool,
                                            preset: str | None) -> None:
    facts = facts_of(DEMO)
    v = judge(machine(available), facts, list_presets())
    assert_consistent(v)
    assert (v.resident, v.preset) == (resident, preset)
    if not resident and preset is not None:
        # advice scaled to the model: every budget is cut to what it can use
        assert all(p.planned < 150 * MB for p in v.presets)
        assert all(p.reads.trunk_bytes == 0 for p in v.presets if p.name != "ultra")


def test_a_synthetic_model_on_several_machines(synth: Path) -> None:
    facts = facts_of(synth)
    seen = set()
    for available in (50 * MB, 200 * MB, 400 * MB, 2 * GB, 24 * GB):
        v = judge(machine(available), facts, list_presets())
        assert_consistent(v)
        seen.add((v.resident, v.preset))
    assert (True, None) in seen and any(not r and p is not None for r, p in seen)


def test_the_report_follows_the_verdict(synth: Path) -> None:
    """Through run_doctor (memory injected): the memory line, each preset's line, the fit
    section and the next command name the same preset; resident means no pack-trunk."""
    seen = []
    for available in (300 * MB, 24 * GB):
        r = run_doctor(synth, disk_probe=False, available=available, total=2 * available,
                       baseline=BASE)
        assert r.verdict is not None
        v = r.verdict
        assert_consistent(v)
        seen.append(v.resident)
        names = {c.name: c for c in r.checks}
        if v.resident:
            assert "resident" in names and "preset" not in names
            assert not any(c.name.startswith("preset ") for c in r.checks)
            assert "room for the trunk" not in names
            assert r.next_commands and not any("pack-trunk" in c or "--trunk" in c
                                               for c in r.next_commands)
        else:
            assert v.preset is not None
            assert f"--preset {v.preset}" in names["preset"].detail
            assert names[f"preset {v.preset}"].status in ("ok", "info", "warn")
            assert f"preset {v.preset}" in {c.name for c in r.checks if c.section == "fit"}
            assert r.next_commands[0].startswith("k3 pack-trunk")
            assert f"--preset {v.preset}" in r.next_commands[1]
    assert seen == [False, True]


def _consistent_report(doc: dict) -> None:
    checks = doc["checks"]
    v = doc["verdict"]
    rated = {p["name"]: p for p in v["presets"]}
    assert doc["preset"] == v["preset"]
    for c in checks:
        if c["section"] == "disk" and c["name"].startswith("preset ") and c["status"] == "ok":
            p = rated[c["name"].removeprefix("preset ")]
            assert p["fits_memory"] and p["slow"] is False
    mem = next(c for c in checks if c["section"] == "memory" and c["name"] != "RAM")
    if doc["resident"]:
        assert mem["name"] == "resident" and doc["preset"] is None
        assert not any("pack-trunk" in c or "--trunk" in c for c in doc["next_commands"])
    elif doc["preset"] is not None:
        assert f"--preset {doc['preset']}" in mem["detail"]
        assert rated[doc["preset"]]["fits_memory"]
        assert all(f"--preset {doc['preset']}" in c for c in doc["next_commands"]
                   if c.startswith("k3 run"))


def test_cli_on_the_demo_model_is_consistent_and_sized_to_it() -> None:
    res = runner.invoke(app, ["doctor", str(DEMO), "--probe-mb", "1", "--json", "-q"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    _consistent_report(doc)
    # the 8 MB model fits any machine that runs the tests: run it resident, pack nothing
    assert doc["resident"] and doc["preset"] is None
    assert doc["next_commands"] == [f"k3 run {DEMO} --tok {DEMO} --prompt "
                                    "'The capital of France is' --gen 8 --incremental"]
    assert not any(c["name"].startswith("preset ") or c["name"] == "room for the trunk"
                   for c in doc["checks"])


def test_cli_without_a_model_is_consistent() -> None:
    res = runner.invoke(app, ["doctor", "--no-disk-probe", "--json", "-q"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    _consistent_report(doc)
    assert not doc["resident"]  # Kimi K3 never fits whole
    shipped = [c for c in doc["checks"] if c["name"].startswith("preset ")]
    assert len(shipped) >= 6 and all(c["status"] != "ok" for c in shipped)  # speed unmeasured
