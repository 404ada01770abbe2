"""``k3 presets`` tells the truth about ``--trunk``: each preset it says runs without a packed
trunk does (its trunk resident), and each it says needs one is refused without one and runs
with one. It used to say every preset needs ``--trunk`` while ``laptop`` and ``auto`` ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_user_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CONFIG_DIR", str(tmp_path / "k3config"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    work = disk_backed_dir(tmp_path_factory.mktemp("presets-trunk"))
    model = synthesize(work / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 1)
    res = runner.invoke(app, ["pack-trunk", str(model), str(work / "trunk")])
    assert res.exit_code == 0, res.output
    return model, work / "trunk"


def _said() -> tuple[dict[str, bool], list[str]]:
    """What ``k3 presets`` says: needs --trunk by name (auto included), and the table."""
    doc = json.loads(runner.invoke(app, ["presets", "--json"]).output)
    needs = {p["name"]: p["needs_trunk"] for p in doc["presets"]}
    needs["auto"] = "runs without --trunk" not in doc["auto"]
    table = runner.invoke(app, ["presets"]).output.splitlines()
    return needs, table


def test_the_table_and_the_json_agree() -> None:
    needs, table = _said()
    assert not needs["laptop"] and not needs["auto"] and needs["ultra"]
    for name, need in needs.items():
        row = next(ln for ln in table if ln.startswith(f"  {name} "))
        assert ("(needs --trunk" in row or ", needs --trunk)" in row) == need, row
    closing = next(ln for ln in table if ln.startswith("The trunk budget applies"))
    assert closing.endswith(f"Only {', '.join(n for n, v in needs.items() if v)} needs --trunk.")


def test_each_preset_runs_or_is_refused_as_k3_presets_says(tiny) -> None:
    model, trunk = tiny
    needs, _ = _said()
    for name, need in needs.items():
        res = runner.invoke(app, ["run", str(model), "--preset", name, "--ids", "3,7", "-n", "1",
                                  "-q"])
        if need:
            assert res.exit_code == 2, (name, res.output)
            assert "needs --trunk DIR" in res.output, (name, res.output)
            with_trunk = runner.invoke(app, ["run", str(model), "--preset", name, "--trunk",
                                             str(trunk), "--ids", "3,7", "-n", "1", "-q"])
            assert with_trunk.exit_code == 0, (name, with_trunk.output)
        else:
            assert res.exit_code == 0, (name, res.output)
