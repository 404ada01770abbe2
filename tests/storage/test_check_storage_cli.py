"""``k3 backends --check-storage NAME MODEL_DIR [--trunk DIR]`` on a tiny model and its packed
trunk: a good backend reads every tensor and layer as ``plain`` does (exit 0); a backend that
loses offset bits, and one whose trunk reads fail, are named with the read and the first
differing byte (exit 1); usage mistakes are one line and exit 2. Through the real CLI app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner, Result

from k3.plugin import StorageBackendSpec, hookimpl
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.plugins.registry import get_registry
from k3core.testing.faulty_backend import available_storage, env, register_faulty, unregister_faulty
from k3core.tools.synth.writer import synthesize
from k3core.trunk.pack import pack_trunk

runner = CliRunner()


class _TestPlugin:
    @hookimpl
    def k3_storage_backends(self) -> list[StorageBackendSpec]:
        return [StorageBackendSpec(name="drop-low-bits", factory="broken_storage:DropLowBitsSmall",
                                   description="test only: large reads lose offset bits",
                                   priority=-100)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from k3core.testing.faulty_backend import disk_backed_dir

    work = disk_backed_dir(tmp_path_factory.mktemp("check-storage"))
    cfg = ModelConfig.from_json_dict(size_config("tiny"))
    model = synthesize(work / "tiny", cfg, 0)
    trunk = work / "trunk"
    storage = PlainStorage()
    with CheckpointIndex.open(model, storage) as index:
        pack_trunk(index, cfg, trunk, storage)
    return model, trunk


@pytest.fixture
def registered() -> object:
    reg = get_registry()
    if "drop-low-bits" not in reg.names("storage"):
        reg.add_plugin(_TestPlugin(), "k3 tests (broken_storage)", "drop-low-bits")
    register_faulty(reg)
    yield reg
    reg.entries.get("storage", {}).pop("drop-low-bits", None)
    reg._probes.pop(("storage", "drop-low-bits"), None)
    unregister_faulty(reg)


def k3(*args: object, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, [str(a) for a in args], env=env)


@pytest.mark.parametrize("name", [n for n in ("mmap", "direct") if n in available_storage()])
def test_a_good_backend_reads_every_byte_as_plain(model: tuple[Path, Path], name: str) -> None:
    model_dir, trunk = model
    res = k3("backends", "--check-storage", name, model_dir, "--trunk", trunk)
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"storage '{name}' against 'plain' on {model_dir}"
    assert "tensors in 15 files, 13 trunk layers of" in lines[1]
    assert lines[-1] == (f"result      : identical: every byte read through '{name}' is what "
                         "'plain' read")
    assert "k3: checked trunk.bin: 13 reads" in res.stderr
    assert "error" not in res.stderr


def test_a_backend_losing_offset_bits_is_named(model: tuple[Path, Path], registered: object) -> None:
    model_dir, trunk = model
    res = k3("backends", "--check-storage", "drop-low-bits", model_dir, "--trunk", trunk)
    assert res.exit_code == 1, res.stdout + res.stderr
    differs = [line for line in res.stdout.splitlines() if line.startswith("  DIFFERS")]
    assert len(differs) == 10, res.stdout
    assert "result      : DIFFERENT: " in res.stdout
    err = [line for line in res.stderr.splitlines() if line.startswith("k3: error:")]
    assert len(err) == 1, res.stderr
    assert err[0].startswith("k3: error: storage backend 'drop-low-bits' differs from 'plain' in ")
    assert " reads; first: tensor " in err[0]
    assert ": 0 of " not in err[0] and "bytes differ; first at +" in err[0]
    assert "got 0x" in err[0] and "plain read 0x" in err[0]
    doc = json.loads(k3("backends", "--check-storage", "drop-low-bits", model_dir, "--json").stdout)
    assert doc["identical"] is False and doc["differing"] >= 1 and doc["trunk_dir"] is None
    first = doc["problems"][0]
    assert first["what"].startswith("tensor ") and first["nbytes"] > 16384
    assert "bytes differ; first at +" in first["detail"] and "(file offset " in first["detail"]


def test_failed_trunk_reads_are_named(model: tuple[Path, Path], registered: object) -> None:
    model_dir, trunk = model
    res = k3("backends", "--check-storage", "faulty", model_dir, "--trunk", trunk,
             env=env(inner="plain", match="trunk.bin", after=0))
    assert res.exit_code == 1, res.stdout + res.stderr
    assert "  DIFFERS   : trunk layer 0 (trunk.bin [" in res.stdout
    assert "'faulty' failed a read plain completes: " in res.stdout
    assert "differs from 'plain' in 13 of 929 reads; first: trunk layer 0" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--check-storage", "mmap", "{missing}"], "model directory {missing} does not exist"),
    (["--check-storage", "no-such-backend", "{model}"], "unknown storage backend 'no-such-backend'"),
    (["--check-storage", "mmap", "{model}", "--trunk", "{missing}"], "--trunk {missing} does not exist"),
    (["--trunk", "{model}"], "--trunk goes with --check-storage NAME MODEL_DIR"),
    (["--check", "--check-storage", "mmap", "{model}"], "--check and --check-storage are separate"),
])
def test_usage_mistakes(model: tuple[Path, Path], tmp_path: Path, args: list[str],
                        message: str) -> None:
    fill = {"missing": tmp_path / "nope", "model": model[0]}
    res = k3("backends", *[a.format(**fill) for a in args])
    assert res.exit_code == 2, res.stdout + res.stderr
    assert res.stderr.startswith(f"k3: error: {message.format(**fill)}"), res.stderr
    assert res.stdout == ""
