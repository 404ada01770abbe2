"""``k3 pack-trunk --codec auto`` (the default): the codec is measured before packing on the
trunk's own disk and bytes; a small trunk and a sparse checkpoint are packed raw without
measuring; whatever it picks streams the same bits."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import k3 as k3api
from k3core.cli.app import app
from k3core.tools.bench import codec_choice
from k3core.trunk.manifest import MANIFEST_NAME


def k3(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model = tmp_path_factory.mktemp("auto") / "small"
    assert k3("synth", model, "--size", "small", "--seed", "4").exit_code == 0
    return model


def test_a_small_trunk_is_packed_raw_without_measuring(small, tmp_path) -> None:
    res = k3("pack-trunk", small, tmp_path / "t")
    assert res.exit_code == 0, res.output
    assert "codec auto: chose none" in res.output and "is packed raw" in res.output
    assert json.loads((tmp_path / "t" / MANIFEST_NAME).read_text()).get("codec", "none") == "none"
    assert not list((tmp_path / "t").glob(".k3-diskbench*"))


def test_the_measured_choice_streams_the_same_ids(small, tmp_path, monkeypatch) -> None:
    """The measurement on a small trunk (the size rule off, a small probe): every candidate
    and the disk are reported, the choice is the best delivery (or none), and the packed
    trunk gives the resident run's ids."""
    monkeypatch.setattr(codec_choice, "SMALL_TRUNK", 0)
    monkeypatch.setattr(codec_choice, "PROBE_BYTES", 16 * 10**6)
    monkeypatch.setattr(codec_choice, "SAMPLE_BYTES", 4 * 10**6)
    res = k3("pack-trunk", small, tmp_path / "t")
    assert res.exit_code == 0, res.output
    assert "codec auto: the disk reads" in res.output
    for name in codec_choice.CANDIDATES:
        assert f"  {name}:" in res.output or f"  {name} " in res.output, name
    chose = next(line for line in res.output.splitlines() if line.startswith("  chose "))
    man = json.loads((tmp_path / "t" / MANIFEST_NAME).read_text())
    assert chose.split()[1].split(":")[0] == man.get("codec", "none")
    assert not list((tmp_path / "t").glob(".k3-diskbench*"))  # the probe file is gone
    ids = []
    for kw in ({"cache_gb": 1.0}, {"trunk": tmp_path / "t", "trunk_gb": 0.01, "cache_gb": 0.001}):
        with k3api.load(small, backend="numpy", **kw) as eng:
            ids.append(list(eng.generate([3, 7, 11], max_tokens=4, ignore_eos=True).ids))
    assert ids[0] == ids[1] and len(ids[0]) == 4


def test_a_coded_trunk_must_beat_raw_by_the_margin() -> None:
    c = codec_choice.CodecChoice("none", 2.0, "probe", [("bp-bits", 1.4, 2.05, 2.05)])
    assert "chose none" in "\n".join(c.lines())


def test_a_sparse_checkpoint_is_packed_raw(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(codec_choice, "SMALL_TRUNK", 0)
    model = tmp_path / "sparse"
    assert k3("synth", model, "--size", "small", "--sparse", "--seed", "2").exit_code == 0
    res = k3("pack-trunk", model, tmp_path / "t")
    assert res.exit_code == 0, res.output
    assert "codec auto: chose none: the checkpoint has holes" in res.output


def test_auto_refuses_an_existing_trunk_before_measuring(small, tmp_path, monkeypatch) -> None:
    assert k3("pack-trunk", small, tmp_path / "t", "--codec", "none").exit_code == 0
    monkeypatch.setattr(codec_choice, "SMALL_TRUNK", 0)
    res = k3("pack-trunk", small, tmp_path / "t")
    assert res.exit_code == 2 and "already holds a packed trunk" in res.output
    assert "codec auto" not in res.output
