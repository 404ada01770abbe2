"""The real-shape rehearsal: its table from real run reports (fast), and the full run at the
released shape under ``laptop`` (slow: ``make rehearsal`` does the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.tools import rehearsal

GB = 1e9


def k3(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_table_from_a_streamed_sparse_run(tmp_path, capsys) -> None:
    model, trunk, out = tmp_path / "m", tmp_path / "t", tmp_path / "laptop.json"
    assert k3("synth", model, "--size", "small", "--sparse").exit_code == 0
    assert k3("pack-trunk", model, trunk).exit_code == 0
    res = k3("run", model, "--trunk", trunk, "--trunk-gb", "0.05", "--ids", "1,2", "--gen", "2",
             "--out", out)
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rehearsal.main([str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | peak RSS | vs 8.24 GB |") and len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "laptop" and cells[1] == f"{rep['peak_rss_bytes'] / GB:.2f} GB"
    assert cells[6] == f"{rep['trunk_exposed_wait_seconds']:.1f}"


def test_table_refuses_what_is_not_a_report(tmp_path, capsys) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"peak_rss_bytes": 1}')
    assert rehearsal.main([str(bad)]) == 2
    assert rehearsal.main([str(tmp_path / "missing.json")]) == 2
    assert rehearsal.main([]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(e.startswith("k3: error: ") for e in err)


@pytest.mark.slow
def test_full_shape_laptop_rehearsal(tmp_path) -> None:
    """The released shape, sparse: budget and pack-trunk work, the packed trunk stays sparse,
    and ``laptop --gen 2`` peaks at no more than the reference's 8.24 GB and reports its
    trunk overlap. Tens of minutes on two cores."""
    model, trunk, out = tmp_path / "model", tmp_path / "trunk", tmp_path / "laptop.json"
    assert k3("synth", model, "--size", "full", "--sparse").exit_code == 0
    assert sum(p.stat().st_blocks * 512 for p in model.iterdir()) < 400e6
    res = k3("budget", model)
    assert res.exit_code == 0 and "108.81 GB over 93 layers" in res.output
    assert k3("pack-trunk", model, trunk).exit_code == 0
    st = os.stat(trunk / "trunk.bin")
    assert st.st_size > 108e9 and st.st_blocks * 512 < 200e6
    run = subprocess.run(  # its own process, so the peak RSS is the run's alone
        [sys.executable, "-m", "k3core", "run", str(model), "--trunk", str(trunk), "--preset",
         "laptop", "--ids", "1", "--gen", "2", "--out", str(out)],
        capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert len(rep["generated_ids"]) == 2
    assert rep["peak_rss_bytes"] <= rehearsal.REFERENCE_LAPTOP_RSS
    assert rep["trunk_read_seconds"] > 0 and "trunk_exposed_wait_seconds" in rep
    assert "trunk_overlapped_seconds" in rep
