"""A preset file is judged the same way by ``--preset`` and ``k3 presets validate``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.presets import PresetError, check_preset_file, file_problems, load_preset
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    d = tmp_path / "k3config"
    monkeypatch.setenv("K3_CONFIG_DIR", str(d))
    return d / "presets"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("presetfiles") / "tiny"
    synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), seed=1)
    return out


def k3(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_a_preset_naming_a_plugin_runs(model, tmp_path):
    f = tmp_path / "my-box.yaml"
    f.write_text("name: my-box\ntrunk_gb: 1\ncache_gb: 0.01\nbackend: numpy\n"
                 "storage: plain\ncache_policy: lru\n")
    res = k3("run", model, "--ids", "3", "--gen", "1", "--preset", f)
    assert res.exit_code == 0, res.output
    assert "k3: error" not in res.output


def test_a_user_preset_by_name_naming_a_plugin_runs(model, user_dir):
    user_dir.mkdir(parents=True)
    (user_dir / "my-box.yaml").write_text("name: my-box\ntrunk_gb: 1\ncache_gb: 0.01\n"
                                          "backend: numpy\n")
    res = k3("run", model, "--ids", "3", "--gen", "1", "--preset", "my-box")
    assert res.exit_code == 0, res.output


def test_a_preset_naming_an_unknown_plugin_is_refused(model, tmp_path):
    f = tmp_path / "my-box.yaml"
    f.write_text("name: my-box\ntrunk_gb: 1\ncache_gb: 0.01\nbackend: cuda\n")
    res = k3("run", model, "--ids", "3", "--gen", "1", "--preset", f)
    assert res.exit_code == 2 and "kernel backend 'cuda' is not registered" in res.output


def test_name_that_differs_from_the_file_name_is_refused_by_both(model, tmp_path):
    f = tmp_path / "fast.yaml"
    f.write_text("name: slow\ntrunk_gb: 1\ncache_gb: 0.01\n")
    res = k3("presets", "validate", f)
    assert res.exit_code == 2 and "make them agree" in res.output
    res = k3("run", model, "--ids", "3", "--gen", "1", "--preset", f)
    assert res.exit_code == 2 and "make them agree" in res.output


def test_a_txt_file_is_refused_by_both(model, tmp_path):
    f = tmp_path / "box.txt"
    f.write_text("name: box\ntrunk_gb: 1\ncache_gb: 0.01\n")
    res = k3("presets", "validate", f)
    assert res.exit_code == 2 and ".yaml or .yml" in res.output
    res = k3("run", model, "--ids", "3", "--gen", "1", "--preset", f)
    assert res.exit_code == 2 and ".yaml or .yml" in res.output
    with pytest.raises(PresetError, match=r"\.yaml or \.yml"):
        load_preset(str(f))


def test_validate_reports_every_problem_at_once(tmp_path):
    f = tmp_path / "box.txt"
    f.write_text("name: other\ntrunk_gb: 0\ncache_gb: 1\nturbo: 1\nstorage: nosuch\n")
    preset, problems = file_problems(f)
    assert preset is None
    text = "; ".join(problems)
    for needle in (".yaml or .yml", "trunk_gb", "unknown key 'turbo'", "make them agree",
                   "storage backend 'nosuch' is not registered"):
        assert needle in text
    res = k3("presets", "validate", f)
    assert res.exit_code == 2
    for needle in (".yaml or .yml", "unknown key 'turbo'", "make them agree", "'nosuch'"):
        assert needle in res.output
    assert res.output.count("k3: error:") == 1


def test_a_good_file_is_valid(tmp_path):
    f = tmp_path / "box.yml"
    f.write_text("name: box\ntrunk_gb: 1\ncache_gb: 0.5\nbackend: numpy\n")
    assert check_preset_file(f).name == "box"
    res = k3("presets", "validate", f)
    assert res.exit_code == 0 and "valid preset 'box'" in res.output
