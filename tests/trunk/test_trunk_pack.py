"""``k3 pack-trunk``: aligned verbatim runs, a checked manifest, atomic output, refusals.

Test data lives in pytest's tmp_path unless that is tmpfs (O_DIRECT refuses tmpfs), then
under the checkout's build/ (``k3core.testing.faulty_backend.disk_backed_dir``).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError, StorageError
from k3core.api.units import ALIGN
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.layer_params import trunk_suffixes
from k3core.model.shapes import size_config
from k3core.plugins.registry import get_registry
from k3core.testing.faulty_backend import FaultyStorage, available_storage, disk_backed_dir
from k3core.tools.bench.ladder import K3_CMD
from k3core.tools.synth.writer import synthesize
from k3core.trunk.manifest import DATA_NAME, MANIFEST_NAME, open_trunk
from k3core.trunk.pack import pack_trunk
from k3core.trunk.sample import windows

runner = CliRunner()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("pack"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 1)


@pytest.fixture(scope="module")
def packed(model, work) -> Path:
    out = work / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(model), str(out)])
    assert res.exit_code == 0, res.output
    assert "packed 13 layers" in res.output and "largest layer run" in res.output
    return out


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.mark.parametrize("storage", available_storage())
def test_runs_are_aligned_verbatim_copies(model, packed, storage) -> None:
    cfg = load_config(model / "config.json")
    backend, _, _ = get_registry().create("storage", storage)
    with CheckpointIndex.open(model, backend) as idx:
        man = open_trunk(packed, idx, cfg, verify=True)
        doc = json.loads((packed / MANIFEST_NAME).read_text())
        assert doc["format"] == "k3-trunk" and doc["version"] == 1 and doc["align"] == ALIGN
        assert doc["source_fingerprint"] == idx.fingerprint()
        assert doc["config_fingerprint"] == list(cfg.fingerprint())
        blob = (packed / DATA_NAME).read_bytes()
        assert len(blob) == man.total_bytes == sum(lay.nbytes for lay in man.layers)
        pos = 0
        for L, lay in enumerate(man.layers):
            assert lay.layer == L and lay.file_off == pos and lay.file_off % ALIGN == 0
            assert lay.nbytes % ALIGN == 0 and lay.nbytes - ALIGN < lay.span <= lay.nbytes
            assert set(lay.tensors) == {names.layer_name(L, s) for s in trunk_suffixes(cfg, L)}
            for t in lay.tensors.values():
                got = blob[lay.file_off + t.off : lay.file_off + t.off + t.nbytes]
                assert got == idx.read(t.name).tobytes(), t.name
            assert blob[lay.file_off + lay.span : lay.file_off + lay.nbytes] == bytes(lay.nbytes - lay.span)
            pos += lay.nbytes


def test_packing_is_deterministic_and_force_replaces(model, packed, work) -> None:
    again = work / "again"
    assert runner.invoke(app, ["pack-trunk", str(model), str(again)]).exit_code == 0
    assert (again / DATA_NAME).read_bytes() == (packed / DATA_NAME).read_bytes()
    assert json.loads((again / MANIFEST_NAME).read_text())["layers"] == \
        json.loads((packed / MANIFEST_NAME).read_text())["layers"]
    res = runner.invoke(app, ["pack-trunk", str(model), str(again)])
    assert res.exit_code == 2 and "--force" in res.output
    assert runner.invoke(app, ["pack-trunk", str(model), str(again), "--force"]).exit_code == 0
    assert _files(again) == [DATA_NAME, MANIFEST_NAME]


def _rewrite_shard(path: Path, order: list[str], tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file whose data section holds ``order`` in exactly that order."""
    dt = {np.dtype(np.uint16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
    header: dict = {}
    pos = 0
    for name in order:
        a = tensors[name]
        header[name] = {"dtype": dt[a.dtype], "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors[n].tobytes() for n in order))


def _copy_model(src: Path, dst: Path) -> None:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())


def test_refuses_a_layer_with_a_gap(model, work) -> None:
    bad = work / "gap"
    _copy_model(model, bad)
    cfg = load_config(bad / "config.json")
    shard = bad / "model-00002-of-00014.safetensors"
    with CheckpointIndex.open(bad, PlainStorage()) as idx:
        held = [n for n in idx if idx.info(n).path.name == shard.name]
        tensors = {n: idx.read(n) for n in held}
    trunk = [names.layer_name(1, s) for s in trunk_suffixes(cfg, 1)]
    experts = [n for n in held if n not in trunk]
    order = trunk[:3] + experts[:1] + trunk[3:] + experts[1:]  # one expert tensor inside the run
    _rewrite_shard(shard, order, tensors)
    res = runner.invoke(app, ["pack-trunk", str(bad), str(work / "gap-trunk")])
    assert res.exit_code == 1, res.output
    gap = tensors[experts[0]].nbytes
    assert f"layer 1: trunk tensors are not one contiguous run: {gap} bytes of gap" in res.output
    assert _files(work / "gap-trunk") == []


def test_refuses_a_layer_across_two_shards(model, work) -> None:
    bad = work / "split"
    _copy_model(model, bad)
    s2, s3 = bad / "model-00002-of-00014.safetensors", bad / "model-00003-of-00014.safetensors"
    moved = names.layer_name(1, "input_layernorm.weight")
    with CheckpointIndex.open(bad, PlainStorage()) as idx:
        t2 = {n: idx.read(n) for n in idx if idx.info(n).path == s2}
        t3 = {n: idx.read(n) for n in idx if idx.info(n).path == s3}
    t3[moved] = t2.pop(moved)
    _rewrite_shard(s2, list(t2), t2)
    _rewrite_shard(s3, list(t3), t3)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"][moved] = s3.name
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    res = runner.invoke(app, ["pack-trunk", str(bad), str(work / "split-trunk")])
    assert res.exit_code == 1, res.output
    assert "layer 1: trunk tensors span 2 shards" in res.output


def test_unwritable_destination_is_exit_3_with_nothing_left(model, work) -> None:
    blocker = work / "a-file"
    blocker.write_text("not a directory")
    res = runner.invoke(app, ["pack-trunk", str(model), str(blocker / "trunk")])
    assert res.exit_code == 3, res.output
    assert "cannot write the packed trunk" in res.output
    if os.geteuid() != 0:  # root ignores directory permissions
        ro = work / "read-only"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            res = runner.invoke(app, ["pack-trunk", str(model), str(ro)])
            assert res.exit_code == 3, res.output
            assert _files(ro) == []
        finally:
            ro.chmod(0o700)


def _small_fsize() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_full_disk_is_exit_3_with_nothing_left(model, work) -> None:
    """RLIMIT_FSIZE makes writes past 1 MiB fail (EFBIG), as a full disk would."""
    out = work / "full"
    proc = subprocess.run([*K3_CMD, "pack-trunk", str(model), str(out)],
                          capture_output=True, text=True, preexec_fn=_small_fsize, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot write the packed trunk" in proc.stderr
    assert _files(out) == []


def test_read_failure_while_packing_leaves_nothing(model, work) -> None:
    cfg = load_config(model / "config.json")
    out = work / "torn"
    faulty = FaultyStorage(PlainStorage(), match="model-00005-of-00014.safetensors", fail_after=0)
    with CheckpointIndex.open(model, PlainStorage()) as idx, pytest.raises(StorageError) as exc:
        pack_trunk(idx, cfg, out, faulty)
    assert "packing layer 4" in exc.value.message
    assert _files(out) == []


def test_failed_repack_keeps_the_old_trunk_whole(model, packed, work) -> None:
    cfg = load_config(model / "config.json")
    out = work / "repack"
    assert runner.invoke(app, ["pack-trunk", str(model), str(out)]).exit_code == 0
    before = (out / DATA_NAME).read_bytes()
    faulty = FaultyStorage(PlainStorage(), match="model-00009-of-00014.safetensors", fail_after=0)
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        with pytest.raises(StorageError):
            pack_trunk(idx, cfg, out, faulty, force=True)
        assert _files(out) == [DATA_NAME, MANIFEST_NAME]
        assert (out / DATA_NAME).read_bytes() == before
        open_trunk(out, idx, cfg, verify=True)


def test_verify_catches_a_flipped_byte(model, packed, work) -> None:
    cfg = load_config(model / "config.json")
    out = work / "flipped"
    assert runner.invoke(app, ["pack-trunk", str(model), str(out)]).exit_code == 0
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        lay = open_trunk(out, idx, cfg).layers[6]
        data = bytearray((out / DATA_NAME).read_bytes())
        sampled = {o + k for o, n in windows(lay.span) for k in range(n)}
        spot = next(o for o in range(lay.span // 3, lay.span) if o not in sampled)
        data[lay.file_off + spot] ^= 0x40
        (out / DATA_NAME).write_bytes(bytes(data))
        open_trunk(out, idx, cfg)  # same size, outside the sampled windows: only checksums tell
        with pytest.raises(CheckpointError, match="layer 6 fails its checksum"):
            open_trunk(out, idx, cfg, verify=True)
