"""Usage errors are one ``k3: error: ...`` line with exit 2, like every other refusal, and
missing input paths follow one rule (exit 2) with a message that says what is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("usage") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


def k3(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert lines[0].startswith("k3: error: "), res.output
    for bad in ("╭", "│", "Usage:", "Traceback", "<bool>", "<int>", "<list", "<str>"):
        assert bad not in lines[0], res.output
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["run", "--gen", "x", "--ids", "3"], "Invalid value for '--gen'"),
    (["run", "--stop-id", "x", "--ids", "3"], "'--stop-id'"),
    (["run", "--nosuch"], "No such option: --nosuch"),
    (["run", "--ids"], "'--ids' requires an argument"),
    (["run", "--bos=3", "--ids", "3"], "does not take a value"),
    (["presets", "validate"], "Missing argument"),
    (["presets", "nosuch"], "No such command 'nosuch'"),
    (["cmp-logits", "a"], "Missing argument"),
    (["nosuchcmd"], "no such command 'nosuchcmd'"),
    (["runn"], "did you mean 'run'"),
])
def test_usage_errors_are_one_line_exit_2(args, needle):
    res = k3(*args)
    assert res.exit_code == 2, res.output
    assert needle in one_error_line(res)


def test_usage_error_goes_to_stderr_in_a_real_process():
    res = subprocess.run([sys.executable, "-m", "k3core.cli", "run", "--gen", "x"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("k3: error: Invalid value for '--gen'")
    assert len(res.stderr.strip().splitlines()) == 1


def test_bare_k3_prints_help_and_exits_2():
    res = k3()
    assert res.exit_code == 2 and "Usage" in res.output


def test_nonexistent_model_dir_says_so(tmp_path):
    res = k3("run", tmp_path / "nowhere", "--ids", "3")
    assert res.exit_code == 2
    assert f"model directory {tmp_path / 'nowhere'} does not exist" in one_error_line(res)


def test_a_dir_without_a_model_names_the_subdirectory_that_has_one(model, tmp_path):
    outer = tmp_path / "download"
    (outer / "snapshots").mkdir(parents=True)
    os.symlink(model, outer / "snapshots" / "abc123")
    res = k3("run", outer, "--ids", "3")
    line = one_error_line(res)
    assert res.exit_code == 2
    assert f"{outer} holds no model" in line and str(outer / "snapshots" / "abc123") in line
    empty = tmp_path / "empty"
    empty.mkdir()
    res = k3("run", empty, "--ids", "3")
    assert res.exit_code == 2 and "holds no model: there is no config.json" in one_error_line(res)
    res = k3("run", model, "--ids", "3", "--config", tmp_path / "nope.json")
    assert res.exit_code == 2 and "--config" in one_error_line(res)


def test_missing_input_files_all_exit_2(model, tmp_path):
    """One rule: a path given on the command line that does not exist is exit 2."""
    missing = tmp_path / "missing"
    for args in (["--trunk", missing], ["--prompt-file", missing, "--tok", model],
                 ["--cache-policy", "replay", "--cache-trace", missing],
                 ["--preset", missing.with_suffix(".yaml")]):
        res = k3("run", model, *(["--ids", "3"] if "--prompt-file" not in args else []),
                 *args)
        assert res.exit_code == 2, (args, res.output)
        assert "Traceback" not in res.output
    assert k3("cmp-logits", missing, missing).exit_code == 2
    assert k3("sim-cache", missing).exit_code == 2
