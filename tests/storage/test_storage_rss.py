"""The memory dial holds on every storage backend: a streamed run's peak RSS does not grow
with what the storage backend has read (mapped pages are released once copied out).

A run of the small synthetic model on a small trunk budget and expert cache, as a child
process per storage backend. ``direct`` keeps nothing but the planned buffers; every
backend must stay within 15 % of the plan of where ``direct`` ends (before the fix,
``mmap`` kept every shard page it had touched mapped: twice ``direct``'s peak here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.faulty_backend import available_storage, disk_backed_dir
from k3core.tools.synth.writer import synthesize


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    work = disk_backed_dir(tmp_path_factory.mktemp("rss"))
    model = synthesize(work / "small", ModelConfig.from_json_dict(size_config("small")), 1)
    trunk = work / "trunk"
    res = subprocess.run([sys.executable, "-m", "k3core.cli", "pack-trunk", str(model),
                          str(trunk)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return model, trunk


def peak_and_plan(model: Path, trunk: Path, storage: str, out: Path) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    res = subprocess.run(
        [sys.executable, "-m", "k3core.cli", "run", str(model), "--ids", "3,7,11", "--gen", "1",
         "--trunk", str(trunk), "--trunk-gb", "0.012", "--cache-gb", "0.004",
         "--storage", storage, "--backend", "numpy", "--incremental", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    rec = json.loads(out.read_text())
    return rec["peak_rss_bytes"], rec["memory_plan"]["total"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS as Linux counts it")
def test_peak_rss_does_not_depend_on_the_storage_backend(packed, tmp_path):
    model, trunk = packed
    names = available_storage()
    base = "direct" if "direct" in names else "plain"
    ref_peak, plan = peak_and_plan(model, trunk, base, tmp_path / f"{base}.json")
    for name in names:
        if name == base:
            continue
        peak, plan_n = peak_and_plan(model, trunk, name, tmp_path / f"{name}.json")
        assert plan_n == pytest.approx(plan, rel=0.05)
        assert peak <= ref_peak + 0.15 * plan, (
            f"storage {name}: peak RSS {peak / 1e6:.1f} MB against {ref_peak / 1e6:.1f} MB "
            f"with {base} and a {plan / 1e6:.1f} MB plan")
