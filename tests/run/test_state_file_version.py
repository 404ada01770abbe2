"""Session files: the format version moved to 2 when the KV cache began to hold the MLA
latent, and to 3 when a checksum began to cover the header (ids, position, model); a file
of another version is refused in one line with exit 2, nothing loaded: one of an older k3
says so, and that it cannot be resumed."""

from __future__ import annotations

import struct

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.state_file import MAGIC, VERSION
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("out") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=1)


def k3(*args):
    return runner.invoke(app, [str(a) for a in args])


def _with_version(data: bytes, version: int) -> bytes:
    return data[:8] + struct.pack("<I", version) + data[12:]


def test_the_file_holds_the_latent_cache_under_version_3(model, tmp_path):
    state = tmp_path / "s.k3s"
    assert k3("run", model, "--ids", "3,7", "-n", "2", "--save-state", state).exit_code == 0
    data = state.read_bytes()
    assert VERSION == 3 and data[:8] == MAGIC and struct.unpack("<I", data[8:12])[0] == 3
    assert b'"kv.3.rows"' in data and b"k_nope" not in data


@pytest.mark.parametrize("version", [1, 2, 4])
def test_another_format_version_is_refused_with_exit_2(model, tmp_path, version):
    state = tmp_path / "s.k3s"
    assert k3("run", model, "--ids", "3,7", "-n", "2", "--save-state", state).exit_code == 0
    old = tmp_path / f"v{version}.k3s"
    old.write_bytes(_with_version(state.read_bytes(), version))
    res = k3("run", model, "--ids", "5", "-n", "1", "--load-state", old)
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("k3: error: ")]
    assert len(errors) == 1 and res.stderr.strip().endswith(errors[0])
    assert f"session format version {version}" in errors[0] and "reads version 3" in errors[0]
    older = "written by an older k3" in errors[0] and "cannot be resumed" in errors[0]
    assert older == (version < 3) and ("newer k3" in errors[0]) == (version > 3)
    assert ("expanded per-head" in errors[0]) == (version == 1)
    assert ("no checksum over its ids" in errors[0]) == (version == 2)
    assert "Traceback" not in res.output
