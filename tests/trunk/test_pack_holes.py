"""``k3 pack-trunk`` keeps holes: a sparse checkpoint packs into a sparse ``trunk.bin`` whose
bytes and CRC-32s are those of the raw runs, and that runs like the resident checkpoint."""

from __future__ import annotations

import json
import os
import random
import zlib

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.trunk.crc import crc32_zeros
from k3core.trunk.holes import data_segments
from k3core.trunk.manifest import DATA_NAME, MANIFEST_NAME


def k3(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("n", [0, 1, 2, 7, 4095, 4096, 65537, 3 << 20])
def test_crc32_of_zeros_without_the_bytes(n) -> None:
    rng = random.Random(n)
    for crc in (0, 0xFFFFFFFF, rng.getrandbits(32)):
        assert crc32_zeros(crc, n) == zlib.crc32(bytes(n), crc)
    with pytest.raises(ValueError):
        crc32_zeros(0, -1)


def test_data_segments_cover_every_written_byte(tmp_path) -> None:
    p = tmp_path / "sparse.bin"
    size = 8 << 20
    with open(p, "wb") as f:
        f.truncate(size)
        for off in (0, 3 << 20, size - 10):
            f.seek(off)
            f.write(b"\x01" * 10)
    segs = data_segments(p, 0, size)
    covered = sum(n for _, n in segs)
    assert covered < size // 2  # this filesystem keeps holes (tmp is ext4/tmpfs/xfs here)
    for off in (0, 3 << 20, size - 10):
        assert any(a <= off and off + 10 <= a + n for a, n in segs)
    inner = data_segments(p, 1 << 20, 1 << 20)  # a window of holes only
    assert inner == []
    assert data_segments(p, 5, 0) == []


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("holes")
    model, trunk = d / "medium", d / "trunk"
    assert k3("synth", model, "--size", "medium", "--sparse", "--seed", "2").exit_code == 0
    res = k3("pack-trunk", model, trunk)
    assert res.exit_code == 0, res.output
    return model, trunk


def test_packed_trunk_is_sparse_and_holds_the_raw_bytes(packed) -> None:
    model, trunk = packed
    man = json.loads((trunk / MANIFEST_NAME).read_text())
    data = trunk / DATA_NAME
    st = os.stat(data)
    assert st.st_size == sum(L["nbytes"] for L in man["layers"]) > 900e6
    assert st.st_blocks * 512 < 20e6  # holes stayed holes
    with open(data, "rb") as f:
        for L in man["layers"][:3] + man["layers"][-2:]:
            f.seek(L["file_off"])
            got = f.read(L["nbytes"])
            assert L["checksum"] == f"crc32:{zlib.crc32(got[: L['span']]):08x}"
            assert got[L["span"]:] == bytes(L["nbytes"] - L["span"])


@pytest.mark.slow
def test_sparse_trunk_runs_like_the_checkpoint(packed, tmp_path) -> None:
    model, trunk = packed
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert k3("run", model, "--ids", "1,2,3", "--gen", "2", "--out", a).exit_code == 0
    res = k3("run", model, "--trunk", trunk, "--trunk-gb", "0.3", "--verify-trunk",
             "--ids", "1,2,3", "--gen", "2", "--out", b)
    assert res.exit_code == 0, res.output
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["generated_ids"] == rb["generated_ids"]
    assert rb["trunk_bytes_read"] > 0
