"""One local Ray cluster for every test here (a start costs seconds), and tiny models.

The fixtures are package-scoped (this directory is a package for that): the cluster is
stopped once the last test here has run, not left running under the rest of the suite.

Ray is optional: without it these tests skip, unless ``K3_TEST_REQUIRE`` names ``ray`` (CI
does), in which case they fail.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from required import required
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize


@pytest.fixture(scope="package")
def ray_session():
    try:
        import ray
    except ImportError:
        if "ray" in required():
            pytest.fail("Ray is required (K3_TEST_REQUIRE names ray) but not installed: "
                        "pip install 'k3[ray]'")
        pytest.skip("Ray is not installed (pip install 'k3[ray]')")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tmp = tempfile.mkdtemp(prefix="k3ray-")
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, _temp_dir=tmp)
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="package")
def pool(ray_session):
    """Three workers reused by every identity test (each run rebinds them)."""
    from k3core.cluster.pool import start_pool

    p = start_pool(3, None)
    yield p
    p.close()


@pytest.fixture(scope="package")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cluster") / "tiny"
    synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), seed=5)
    return out


@pytest.fixture(scope="package")
def tiny_trunk(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cluster") / "trunk"
    res = CliRunner().invoke(app, ["pack-trunk", str(tiny), str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="package")
def tiny_shares(tiny, tmp_path_factory):
    """``k3 shard-experts`` of the tiny model for 2 and 3 workers: ``{n: OUT_DIR}``."""
    out = {}
    for n in (2, 3):
        d = tmp_path_factory.mktemp("shares") / f"n{n}"
        res = CliRunner().invoke(app, ["shard-experts", str(tiny), str(d), "--workers", str(n),
                                       "--storage", "mmap", "-q"])
        assert res.exit_code == 0, res.output
        out[n] = d
    return out


@pytest.fixture(scope="package")
def other_tiny(tmp_path_factory) -> Path:
    """The tiny shape with other weights: another model."""
    out = tmp_path_factory.mktemp("cluster") / "other"
    synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), seed=6)
    return out
