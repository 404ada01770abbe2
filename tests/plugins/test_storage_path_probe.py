"""``auto`` picks a storage backend that can read the model's directory: the storage
contract's optional ``probe_path`` hook, asked by the registry for each candidate, best
first (``direct`` says no where the filesystem refuses O_DIRECT).

``picky`` is a real storage plugin registered in this process: it reads through ``plain``
and says it cannot read a directory holding a file named ``NOT-FOR-PICKY`` (and there
refuses to open a file).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3.plugin import (
    Availability,
    StorageBackend,
    StorageBackendSpec,
    StorageError,
    StorageFile,
    create,
    hookimpl,
)
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.plugins.registry import get_registry
from k3core.tools.synth.writer import synthesize

MARKER = "NOT-FOR-PICKY"


class PickyStorage(StorageBackend):
    name = "picky"

    def __init__(self) -> None:
        super().__init__()
        self.inner = create("storage", "plain")
        self.stats = self.inner.stats

    def open(self, path: str | Path) -> StorageFile:
        if (Path(path).parent / MARKER).exists():  # what its probe_path says, it holds to
            raise StorageError(f"picky cannot read {path}: {MARKER} is there")
        return self.inner.open(path)

    @classmethod
    def probe_path(cls, path: Path) -> Availability:
        folder = path if path.is_dir() else path.parent
        if (folder / MARKER).exists():
            return Availability.no(f"{MARKER} is there", "use another backend")
        return Availability.yes()


class RaisingProbe(PickyStorage):
    name = "raising"

    @classmethod
    def probe_path(cls, path: Path) -> Availability:
        raise OSError("the probe itself broke")


class _Plugin:
    @hookimpl
    def k3_storage_backends(self) -> list[StorageBackendSpec]:
        return [
            StorageBackendSpec(name="picky", factory=f"{__name__}:PickyStorage", priority=1000),
            StorageBackendSpec(name="raising", factory=f"{__name__}:RaisingProbe", priority=999),
        ]


@pytest.fixture
def registered() -> Iterator[None]:
    reg = get_registry()
    reg.add_plugin(_Plugin(), "tests (picky)", "picky")
    yield
    for name in ("picky", "raising"):
        reg.entries["storage"].pop(name, None)
        reg._probes.pop(("storage", name), None)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(tmp_path_factory.mktemp("picky") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=4)


def test_auto_skips_a_backend_that_cannot_read_the_path_and_says_why(registered, tmp_path):
    reg = get_registry()
    (tmp_path / MARKER).touch()
    spec, note = reg.resolve("storage", "auto", for_path=tmp_path)
    assert spec.name not in ("picky", "raising")
    assert note.startswith(f"storage backend 'picky' cannot read {tmp_path} ({MARKER} is there)"
                           f"; storage backend 'raising' cannot read {tmp_path} (its probe_path "
                           "raised OSError('the probe itself broke'))")
    assert note.endswith(f"; auto picked storage backend '{spec.name}'")
    (tmp_path / MARKER).unlink()
    assert reg.resolve("storage", "auto", for_path=tmp_path) == (
        reg.entries["storage"]["picky"].spec, "auto picked storage backend 'picky'")


def test_without_a_path_and_by_name_nothing_is_path_probed(registered, tmp_path):
    reg = get_registry()
    (tmp_path / MARKER).touch()
    assert reg.resolve("storage", "auto")[0].name == "picky"
    assert reg.resolve("storage", "raising", for_path=tmp_path)[0].name == "raising"
    backend, name, _ = reg.create("storage", "auto", for_path=tmp_path)
    assert name not in ("picky", "raising") and isinstance(backend, StorageBackend)


def test_a_run_picks_its_storage_for_the_model_directory(registered, model, tmp_path):
    """``k3 run`` with storage ``auto``: ``picky`` where it can read the model, the next
    best where it cannot, the reason in the engine's notes on stderr."""

    def run(out: Path) -> tuple[dict, str]:
        res = CliRunner().invoke(app, ["run", str(model), "--ids", "3,7", "-n", "2",
                                       "--ignore-eos", "--out", str(out)])
        assert res.exit_code == 0, res.output
        return json.loads(out.read_text()), res.output

    rec, _ = run(tmp_path / "a.json")
    assert rec["plan"]["storage"] == "picky"
    (model / MARKER).touch()
    try:
        other, text = run(tmp_path / "b.json")
    finally:
        (model / MARKER).unlink()
    assert other["plan"]["storage"] not in ("picky", "raising")
    assert f"storage backend 'picky' cannot read {model} ({MARKER} is there)" in text
    assert other["generated_ids"] == rec["generated_ids"]


@pytest.mark.parametrize("command", ["pack-trunk", "shard-experts", "budget"])
def test_every_command_that_reads_a_model_picks_for_its_directory(registered, model, tmp_path,
                                                                  command):
    """Not only k3 run: each command that opens a model's shards with storage ``auto`` asks
    the candidates about that directory (the note on stderr where it says one)."""
    args = {"pack-trunk": [str(tmp_path / "trunk")],
            "shard-experts": [str(tmp_path / "shares"), "--workers", "2"],
            "budget": []}[command]
    (model / MARKER).touch()
    try:
        res = CliRunner().invoke(app, [command, str(model), *args])
    finally:
        (model / MARKER).unlink()
    assert res.exit_code == 0, res.output
    if command != "budget":  # budget prints no storage note; it must simply read the model
        assert f"storage backend 'picky' cannot read {model} ({MARKER} is there)" in res.stderr
