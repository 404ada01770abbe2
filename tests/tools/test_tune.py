"""``k3 tune``: writes a valid user preset that ``k3 presets show`` lists and ``k3 run
--preset`` uses (same ids as ``--backend numpy``); refuses, and never keeps, a setting whose
ids differ (a real, deliberately wrong kernel backend registered as a plugin); never replaces
a preset without ``--force``; one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.forward import lookahead_mode
from k3core.model.shapes import size_config
from k3core.run.presets import check_preset_file
from k3core.testing.disk import disk_tmpdir
from k3core.testing.wrong_kernels import WRONG, register_wrong_kernels, unregister_wrong_kernels
from k3core.tools.synth.writer import synthesize
from k3core.tools.tune import KNOBS, thread_counts

runner = CliRunner()
IDS = "3,7,11,5,9"
CACHE_GB = f"{10 * 8192 / 1e9:.9f}"


@pytest.fixture(scope="module")
def model():
    with disk_tmpdir("k3-tune-") as d:
        cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 32,
                                                              "num_experts_per_token": 4}))
        yield synthesize(d / "tiny32", cfg, 2)


@pytest.fixture()
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3_CONFIG_DIR", str(tmp_path / "cfg"))
    return tmp_path / "cfg" / "presets"


@pytest.fixture()
def wrong():
    register_wrong_kernels()
    yield WRONG
    unregister_wrong_kernels()


def tune(model: Path, *extra: str) -> object:
    return runner.invoke(app, ["tune", str(model), "--cache-gb", CACHE_GB, "--gen", "2",
                               "--threads", "1", "--expert-readers", "2", "--expert-readers", "4",
                               *extra])


def test_tune_refuses_a_setting_whose_ids_differ_and_writes_a_preset_run_uses(
        model: Path, config_dir: Path, wrong: str, tmp_path: Path) -> None:
    res = tune(model, "--backend", wrong, "--backend", "numpy", "--name", "box", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {"backend": wrong} in doc["refused"]
    refused = [t for t in doc["trials"] if t["setting"] == {"backend": wrong}]
    assert refused and not refused[0]["kept"] and "differ" in refused[0]["note"]
    assert all(t["ids"] == doc["reference"]["ids"] for t in doc["trials"] if t["kept"])
    assert doc["setting"]["backend"] == "numpy"
    path = config_dir / "box.yaml"
    assert Path(doc["preset_path"]) == path
    preset = check_preset_file(path, plugins=True)
    assert preset.backend == "numpy" and preset.threads == 1
    assert preset.lookahead in ("on", "off") and preset.expert_readers in (2, 4)
    assert "REFUSED" not in path.read_text()

    show = runner.invoke(app, ["presets", "show", "box"])
    assert show.exit_code == 0 and f"# from: {path}" in show.output
    listed = runner.invoke(app, ["presets", "--json"])
    assert "box" in [p["name"] for p in json.loads(listed.stdout)["presets"]]

    out = tmp_path / "run.json"
    ran = runner.invoke(app, ["run", str(model), "--preset", "box", "--ids", IDS, "--gen", "2",
                              "--out", str(out), "-v"])
    assert ran.exit_code == 0, ran.output
    rec = json.loads(out.read_text())
    assert rec["generated_ids"] == doc["reference"]["ids"]
    assert rec["backend"] == "numpy" and rec["lookahead"] == lookahead_mode(preset.lookahead or "")
    assert "expert_readers = " in ran.output and "(preset box)" in ran.output


def test_tune_never_replaces_a_preset_without_force(model: Path, config_dir: Path) -> None:
    config_dir.mkdir(parents=True)
    mine = config_dir / "tuned.yaml"
    mine.write_text("name: tuned\ntrunk_gb: 1.0\ncache_gb: 1.0\n")
    res = tune(model, "--backend", "numpy")
    assert res.exit_code == 3 and "--force" in res.output and "Traceback" not in res.output
    assert mine.read_text() == "name: tuned\ntrunk_gb: 1.0\ncache_gb: 1.0\n"
    res = tune(model, "--backend", "numpy", "--force", "--lookahead", "off")
    assert res.exit_code == 0, res.output
    assert check_preset_file(mine).backend == "numpy"


def test_tune_refuses_when_no_backend_keeps_the_ids(model: Path, config_dir: Path,
                                                    wrong: str) -> None:
    res = tune(model, "--backend", wrong)
    assert res.exit_code == 1 and "no kernel backend decoded the reference's ids" in res.output
    assert not (config_dir / "tuned.yaml").exists()


@pytest.mark.parametrize("args, code, words", [
    (["--name", "Bad Name"], 2, "preset name"),
    (["--name", "auto"], 2, "not 'auto'"),
    (["--name", "laptop"], 3, "shipped"),
    (["--gen", "1"], 2, "--gen"),
    (["--ids", "1,x"], 2, "--ids"),
    (["--lookahead", "maybe"], 2, "--lookahead"),
    (["--expert-readers", "0"], 2, "--expert-readers"),
])
def test_tune_refusals_are_one_line(model: Path, config_dir: Path, args: list[str], code: int,
                                    words: str) -> None:
    res = runner.invoke(app, ["tune", str(model), *args])
    assert res.exit_code == code, res.output
    assert words in res.output and "Traceback" not in res.output


def test_the_candidate_table() -> None:
    assert [k.key for k in KNOBS][:1] == ["backend"]
    assert {"threads", "expert_readers", "lookahead"} <= {k.key for k in KNOBS}
    assert thread_counts(1) == [1] and thread_counts(6) == [1, 2, 4, 6] and thread_counts(8) == [1, 2, 4, 8]


def test_a_preset_carries_lookahead_and_expert_readers() -> None:
    from k3core.run.presets import PresetError, parse_preset

    base = "name: a\ntrunk_gb: 1\ncache_gb: 1\n"
    assert parse_preset(base + "lookahead: off\n").lookahead == "off"  # YAML's bare off
    assert parse_preset(base + "lookahead: on\nexpert_readers: 2\n").expert_readers == 2
    for bad in ("lookahead: maybe\n", "expert_readers: 0\n", "expert_readers: 65\n"):
        with pytest.raises(PresetError):
            parse_preset(base + bad)


def test_tune_tries_spec_widths_and_the_preset_carries_them(
        model: Path, config_dir: Path, tmp_path: Path) -> None:
    res = tune(model, "--backend", "numpy", "--lookahead", "off", "--spec", "ngram",
               "--spec-width", "2", "--spec-width", "3", "--name", "specbox", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    tried = [t["setting"] for t in doc["trials"]]
    assert any(s.get("spec_width") == 2 for s in tried) and any(s.get("spec_width") == 3 for s in tried)
    assert all(t["ids"] == doc["reference"]["ids"] for t in doc["trials"] if t["kept"])
    preset = check_preset_file(config_dir / "specbox.yaml", plugins=True)
    assert preset.spec == "ngram" and preset.spec_width in (2, 3)
    out = tmp_path / "spec.json"
    ran = runner.invoke(app, ["run", str(model), "--preset", "specbox", "--ids", IDS, "--gen", "4",
                              "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    assert "speculative decoding: ngram" in ran.output and "(preset specbox)" in ran.output
    rec = json.loads(out.read_text())
    plain = runner.invoke(app, ["run", str(model), "--ids", IDS, "--gen", "4", "--backend", "numpy",
                                "--spec", "off", "--out", str(tmp_path / "plain.json")])
    assert plain.exit_code == 0, plain.output
    assert rec["generated_ids"] == json.loads((tmp_path / "plain.json").read_text())["generated_ids"]
    # a flag still wins over the preset
    off = runner.invoke(app, ["run", str(model), "--preset", "specbox", "--ids", IDS, "--gen", "2",
                              "--spec", "off"])
    assert off.exit_code == 0 and "speculative decoding: ngram" not in off.output


@pytest.mark.parametrize("flags, message", [
    (["--spec", "maybe"], "--spec must be off, ngram or auto"),
    (["--spec-width", "0"], "--spec-width must be in 1..16"),
])
def test_tune_refuses_bad_spec_candidates(model: Path, config_dir: Path, flags: list[str],
                                          message: str) -> None:
    res = runner.invoke(app, ["tune", str(model), *flags])
    assert res.exit_code == 2 and message in res.output
