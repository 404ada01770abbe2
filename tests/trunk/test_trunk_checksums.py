"""A damaged packed trunk (or a streamed table) is refused before its bytes are used.

Four bytes are changed where the open-time sample windows do not look, so only the
per-layer checksum can notice: every storage backend, every budget (all pinned, the floor
with one and two ring slots, half), and ``--ultra-low-memory`` for the embedding and
``lm_head``, which stream from the checkpoint and are checked against the manifest's table
checksums.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from k3_storage.plain import PlainStorage
from thin import thinned
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.shapes import size_config
from k3core.testing.faulty_backend import available_storage, disk_backed_dir
from k3core.tools.synth.writer import synthesize
from k3core.trunk.manifest import DATA_NAME, MANIFEST_NAME, open_trunk
from k3core.trunk.sample import WINDOW, windows
from k3core.trunk.stream import StreamedTrunk

runner = CliRunner()
DAMAGED = 5  # the layer whose bytes are changed


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("crc"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 3)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(model), str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def doc(trunk) -> dict:
    return json.loads((trunk / MANIFEST_NAME).read_text())


def unsampled(span: int) -> int:
    """An offset inside a run of ``span`` bytes that no sample window covers."""
    covered = {o // WINDOW for o, _ in windows(span)}
    free = [w for w in range(span // WINDOW) if w not in covered]
    assert free, "the run is too small to hide a change from the sample"
    return free[0] * WINDOW + 100


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + 4] = bytes(b ^ 0xFF for b in data[offset : offset + 4])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def damaged(trunk, work, doc) -> Path:
    d = work / "damaged"
    shutil.copytree(trunk, d)
    lay = doc["layers"][DAMAGED]
    flip(d / DATA_NAME, lay["file_off"] + unsampled(lay["span"]))
    return d


def budgets(doc: dict) -> dict[str, list[str]]:
    sizes = [lay["nbytes"] for lay in doc["layers"]]
    floor, total = max(sizes), sum(sizes)
    return {"all-pinned": [], "floor-ring1": ["--trunk-gb", f"{floor / 1e9:.9f}", "--trunk-ring", "1"],
            "floor-ring2": ["--trunk-gb", f"{2 * floor / 1e9:.9f}"],
            "half": ["--trunk-gb", f"{total // 2 / 1e9:.9f}"]}


def run(model: Path, trunk: Path, *extra: str):
    return runner.invoke(app, ["run", str(model), "--ids", "3,7,11", "--gen", "2",
                               "--trunk", str(trunk), *extra])


def test_the_undamaged_trunk_runs_and_reports_its_checks(model, trunk):
    res = run(model, trunk)
    assert res.exit_code == 0, res.output
    assert "each layer checked before first use" in res.output
    assert "checksums: 13 layer checks passed" in res.output


@pytest.mark.parametrize("storage", thinned(available_storage(), ("direct", "mmap")))
@pytest.mark.parametrize("budget", ["all-pinned", "floor-ring1", "floor-ring2", "half"])
def test_a_damaged_layer_is_refused_naming_it(model, damaged, doc, storage, budget):
    res = run(model, damaged, "--storage", storage, *budgets(doc)[budget])
    out = " ".join(res.output.split())
    assert res.exit_code == 1, out
    assert f"layer {DAMAGED} fails its checksum" in out
    assert "generated ids" not in out and "Traceback" not in out


def test_verify_every_read_catches_a_change_after_the_first_pass(model, trunk, work, doc):
    d = work / "changes-later"
    shutil.copytree(trunk, d)
    cfg = load_config(model / "config.json")
    floor = max(lay["nbytes"] for lay in doc["layers"])
    lay = doc["layers"][DAMAGED]
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        man = open_trunk(d, idx, cfg)
        # a full walk, then the file changes before the second pass
        for every, caught in ((False, False), (True, True)):
            shutil.copy(trunk / DATA_NAME, d / DATA_NAME)
            tr = StreamedTrunk(cfg, man, PlainStorage(), floor, ring=1, verify_every=every)
            try:
                for L in range(cfg.n_layers):
                    tr.acquire(L)
                    tr.release(L)
                flip(d / DATA_NAME, lay["file_off"] + unsampled(lay["span"]))
                if caught:
                    with pytest.raises(CheckpointError, match=f"layer {DAMAGED} fails its checksum"):
                        for L in range(cfg.n_layers):
                            tr.acquire(L)
                            tr.release(L)
                else:
                    for L in range(cfg.n_layers):
                        tr.acquire(L)
                        tr.release(L)
            finally:
                tr.close()


# ---- --ultra-low-memory: the embedding and lm_head ------------------------------------------
@pytest.fixture
def copy_of_model(model, work, request) -> Path:
    d = work / f"model-{request.node.name}"
    shutil.copytree(model, d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _table_offset(model: Path, name: str, row: int) -> tuple[Path, int]:
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        info = idx.info(name)
        return info.path, info.offset + row * (info.nbytes // info.shape[0])


@pytest.mark.parametrize("table, row", [(names.EMBED, 7), (names.LM_HEAD, 900)])
def test_ultra_refuses_a_damaged_streamed_table(copy_of_model, trunk, work, table, row):
    d = work / f"trunk-for-{copy_of_model.name}"
    assert runner.invoke(app, ["pack-trunk", str(copy_of_model), str(d)]).exit_code == 0
    ok = run(copy_of_model, d, "--ultra-low-memory")
    assert ok.exit_code == 0, ok.output
    path, off = _table_offset(copy_of_model, table, row)
    flip(path, off + 8)
    res = run(copy_of_model, d, "--ultra-low-memory")
    out = " ".join(res.output.split())
    assert res.exit_code == 1, out
    assert f"{table} rows" in out and "fail their checksum" in out
    assert "generated ids" not in out


def test_ultra_refuses_a_trunk_without_table_checksums(model, trunk, work):
    d = work / "old-trunk"
    shutil.copytree(trunk, d)
    man = json.loads((d / MANIFEST_NAME).read_text())
    man.pop("tables")
    (d / MANIFEST_NAME).write_text(json.dumps(man))
    assert run(model, d).exit_code == 0  # the trunk itself still runs
    res = run(model, d, "--ultra-low-memory")
    assert res.exit_code == 1 and "holds no checksums for the embedding and lm_head" in res.output
