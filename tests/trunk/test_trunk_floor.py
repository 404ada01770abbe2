"""One trunk floor everywhere: ``k3 pack-trunk`` names the ``--trunk-gb`` that ``k3 run``
then accepts, and ``k3 run`` refuses below it naming the same figure (pack-trunk used to
say the largest whole layer, 0.01 on the small model, while run streams parts: 0.008)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
FLAG = re.compile(r"--trunk-gb ([0-9.e-]+)")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path, str]:
    """The small model (its largest part and its largest layer round to different MB),
    packed; and what pack-trunk printed."""
    work = disk_backed_dir(tmp_path_factory.mktemp("floor"))
    model = synthesize(work / "small", ModelConfig.from_json_dict(size_config("small")), 1)
    res = runner.invoke(app, ["pack-trunk", str(model), str(work / "trunk")])
    assert res.exit_code == 0, res.output
    return model, work / "trunk", res.output


def _run(model: Path, trunk: Path, gb: str):
    return runner.invoke(app, ["run", str(model), "--trunk", str(trunk), "--trunk-gb", gb,
                               "--ids", "3,7", "-n", "1", "-q"])


def test_pack_trunk_and_run_name_one_floor(packed) -> None:
    model, trunk, said = packed
    line = next(ln for ln in said.splitlines() if "is the floor" in ln)
    floor = FLAG.findall(line)
    assert len(floor) == 1, line
    refused = _run(model, trunk, "0.000001")
    assert refused.exit_code == 2, refused.output
    assert "below the floor" in refused.output
    named = FLAG.findall(refused.output.split("below the floor", 1)[1])
    assert set(named) == {floor[0]}, (line, refused.output)
    # the figure in bytes agrees too
    part = re.search(r"largest streaming part ([0-9.]+ [kMG]?B)", line)
    assert part is not None and f"needs {part.group(1)}" in refused.output
    # and it is the real floor: the run at it goes through
    ok = _run(model, trunk, floor[0])
    assert ok.exit_code == 0, ok.output
