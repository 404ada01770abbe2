"""Every size flag (``--*-gb``, ``--*-mb``) of every command refuses NaN, infinity, a
negative size and an absurd one (above 1 PB) with one ``k3: error:`` line naming the flag,
exit 2, and no traceback (``--cache-gb inf`` used to be a 54-line OverflowError); the Python
API's keywords the same."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3
from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
BAD = ["inf", "nan", "-inf", "1e300", "-1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("sizes") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


# (command line before the flag, the flag); M is the model, T a trunk dir, D a directory
COMMANDS = [
    (["run", "M", "--ids", "3"], "--cache-gb"),
    (["run", "M", "--ids", "3"], "--trunk-gb"),
    (["run", "M", "--ids", "3", "--trunk", "T"], "--trunk-gb"),
    (["serve", "M"], "--cache-gb"),
    (["serve", "M"], "--trunk-gb"),
    (["tune", "M"], "--cache-gb"),
    (["tune", "M"], "--trunk-gb"),
    (["bench", "decode", "M"], "--cache-gb"),
    (["bench", "decode", "M"], "--trunk-gb"),
    (["bench", "decode", "M"], "--bandwidth-mb"),
    (["bench", "io", "D"], "--probe-gb"),
    (["bench", "io", "D"], "--read-mb"),
    (["bench", "codec", "M"], "--disk-gb-s"),
    (["bench", "codec", "M"], "--max-mb"),
    (["bench", "ladder", "M", "T"], "--cache-gb"),
    (["bench", "ladder", "M", "T"], "--headroom-gb"),
    (["bench", "ladder", "M", "T"], "--budgets"),
    (["bench-ladder", "M", "T"], "--cache-gb"),
    (["sim-cache", "TRACE"], "--cache-gb"),
]


def one_error_line(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1, output
    assert lines[0].startswith("k3: error: ") and "Traceback" not in output, output
    return lines[0]


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("cmd, flag", COMMANDS, ids=[f"{' '.join(c[:2])} {f}" for c, f in COMMANDS])
def test_size_flags_refuse_non_finite_and_absurd_values(model, tmp_path, cmd, flag, value):
    where = {"M": str(model), "T": str(tmp_path / "trunk"), "D": str(tmp_path),
             "TRACE": str(tmp_path / "expert_trace.bin")}
    args = [where.get(a, a) for a in cmd] + [f"{flag}={value}"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    line = one_error_line(res.output)
    assert flag in line, line


@pytest.mark.parametrize("cmd, flag", [
    (["run", "M", "--ids", "3", "--trunk", "T"], "--trunk-gb"), (["bench", "io", "D"], "--probe-gb"),
    (["bench", "ladder", "M", "T"], "--budgets"), (["bench", "codec", "M"], "--disk-gb-s"),
    (["sim-cache", "TRACE"], "--cache-gb"),
])
def test_sizes_that_must_be_positive_refuse_zero(model, tmp_path, cmd, flag):
    where = {"M": str(model), "T": str(tmp_path / "trunk"), "D": str(tmp_path),
             "TRACE": str(tmp_path / "expert_trace.bin")}
    res = runner.invoke(app, [where.get(a, a) for a in cmd] + [f"{flag}=0"])
    assert res.exit_code == 2 and flag in one_error_line(res.output), res.output


def test_a_huge_but_possible_budget_is_not_refused_as_absurd(model):
    res = runner.invoke(app, ["run", str(model), "--ids", "3", "-n", "1", "--cache-gb", "1e5", "-q"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("key", ["cache_gb", "trunk_gb"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, -1.0])
def test_python_api_refuses_the_same(model, key, value):
    """The same refusals, naming the keyword (the command line names the flag)."""
    with pytest.raises(UsageError, match=f"^{key} must be a"):
        k3.load(model, **{key: value})
