"""The expert reader pool is sized by the storage device (sysfs queue), with an override."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.experts.readers import DEFAULT_READERS, device_readers

runner = CliRunner()


def _fake_sys(tmp: Path, target: Path, disk: str, rotational: int | None, nr: int | None,
              partition: bool = False) -> Path:
    """A ``/sys/dev/block`` whose entry for ``target``'s device is ``disk`` (or its partition)."""
    root = tmp / "sys" / "dev" / "block"
    root.mkdir(parents=True)
    disk_dir = tmp / "devices" / disk
    (disk_dir / "queue").mkdir(parents=True)
    if rotational is not None:
        (disk_dir / "queue" / "rotational").write_text(f"{rotational}\n")
    if nr is not None:
        (disk_dir / "queue" / "nr_requests").write_text(f"{nr}\n")
    node = disk_dir / f"{disk}1" if partition else disk_dir
    node.mkdir(exist_ok=True)
    dev = os.stat(target).st_dev
    (root / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(node)
    return root


@pytest.mark.parametrize("disk, rotational, nr, partition, want", [
    ("nvme0n1", 0, 1023, False, 15),  # deep queue: many readers
    ("nvme0n1", 0, 1023, True, 15),  # a partition reads its disk's queue
    ("nvme1n1", 0, 4096, False, 16),  # at most 16
    ("sda", 1, 64, False, 2),  # a spinning disk: few readers, more only add seeks
    ("vda", 1, 256, False, 4),  # virtio says rotational whatever backs it: the queue decides
    ("vdb", 1, 768, False, 12),
    ("sdb", 0, 32, False, 4),  # a shallow queue still gets the minimum
    ("sdc", 0, None, False, DEFAULT_READERS),  # no queue depth: the default
])
def test_readers_follow_the_device_queue(tmp_path, disk, rotational, nr, partition, want) -> None:
    f = tmp_path / "shard.safetensors"
    f.write_bytes(b"x")
    root = _fake_sys(tmp_path, f, disk, rotational, nr, partition)
    n, why = device_readers(f, sys_root=root)
    assert n == want and disk in why


def test_no_block_device_gets_the_default(tmp_path) -> None:
    f = tmp_path / "shard"
    f.write_bytes(b"x")
    assert device_readers(f, sys_root=tmp_path / "nothing")[0] == DEFAULT_READERS
    assert device_readers(tmp_path / "missing")[0] == DEFAULT_READERS


@pytest.mark.parametrize("bad", ["0", "65", "-3"])
def test_readers_override_out_of_range_is_refused(tmp_path, bad) -> None:
    res = runner.invoke(app, ["run", str(tmp_path), "--ids", "1", "--readers", bad])
    assert res.exit_code == 2 and "--readers must be in 1..64" in res.output
    assert "Traceback" not in res.output


def test_run_reports_its_readers(tmp_path) -> None:
    from k3core.model.config import ModelConfig
    from k3core.model.shapes import size_config
    from k3core.tools.synth.writer import synthesize

    model = synthesize(tmp_path / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 2)
    res = runner.invoke(app, ["run", str(model), "--ids", "3,7", "--gen", "1", "--readers", "3"])
    assert res.exit_code == 0, res.output
    assert "3 readers (--readers)" in res.output
    res = runner.invoke(app, ["run", str(model), "--ids", "3,7", "--gen", "1"])
    assert res.exit_code == 0 and " readers (" in res.output
