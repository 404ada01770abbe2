"""``k3 synth``: deterministic, released layout, readable by the safetensors package, and
full recompute == incremental on what it writes."""

from __future__ import annotations

import hashlib
import json

import pytest
import safetensors
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import load_config
from k3core.model.layer_params import trunk_suffixes
from k3core.model.names import layer_name


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "tiny"
    res = CliRunner().invoke(app, ["synth", str(out), "--size", "tiny", "--seed", "3"])
    assert res.exit_code == 0, res.output
    return out


def _digest(d):
    h = hashlib.sha256()
    for p in sorted(d.iterdir()):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def test_deterministic_from_seed(tiny, tmp_path):
    again = tmp_path / "again"
    assert CliRunner().invoke(app, ["synth", str(again), "--size", "tiny", "--seed", "3"]).exit_code == 0
    assert _digest(again) == _digest(tiny)
    other = tmp_path / "other"
    assert CliRunner().invoke(app, ["synth", str(other), "--size", "tiny", "--seed", "4"]).exit_code == 0
    assert _digest(other) != _digest(tiny)


def test_layout_is_the_released_one(tiny):
    cfg = load_config(tiny / "config.json")
    assert cfg.shape == "nested"
    conf = json.loads((tiny / "config.json").read_text())
    lac = conf["text_config"]["linear_attn_config"]
    assert sorted(lac["kda_layers"] + lac["full_attn_layers"]) == list(range(1, cfg.n_layers + 1))
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == cfg.n_layers + 1
    with CheckpointIndex.open(tiny, PlainStorage()) as idx:
        a_log = idx.info(layer_name(1, "self_attn.A_log"))
        assert a_log.shape == (max(cfg.kda_heads, cfg.kda_head_dim),) and a_log.dtype == "F32"
        assert idx.info(layer_name(1, "self_attn.q_proj.weight")).dtype == "BF16"
        assert idx.info(layer_name(1, "block_sparse_moe.experts.0.w1.weight_packed")).dtype == "U8"
        # a layer's trunk tensors are one contiguous run inside its shard
        for L in range(cfg.n_layers):
            infos = sorted((idx.info(layer_name(L, s)) for s in trunk_suffixes(cfg, L)), key=lambda i: i.offset)
            assert len({i.path for i in infos}) == 1
            assert all(a.offset + a.nbytes == b.offset for a, b in zip(infos, infos[1:], strict=False))


def test_safetensors_package_reads_back_every_tensor(tiny):
    with CheckpointIndex.open(tiny, PlainStorage()) as idx:
        by_file: dict = {}
        for name in idx:
            by_file.setdefault(idx.info(name).path, []).append(name)
        for path, names in by_file.items():
            ref = {n: t for n, t in safetensors.deserialize(path.read_bytes())}
            assert set(ref) == set(names)
            for name in names:
                got = idx.read(name)
                assert list(got.shape) == ref[name]["shape"]
                assert idx.info(name).dtype == ref[name]["dtype"]
                assert got.tobytes() == bytes(ref[name]["data"])


def test_full_recompute_equals_incremental(tiny, tmp_path):
    outs = []
    for flag in ([], ["--incremental"]):
        out = tmp_path / f"r{len(flag)}.json"
        dump = tmp_path / f"l{len(flag)}.f32"
        args = ["run", str(tiny), "--ids", "3,7,11,5,9", "--gen", "6", "--out", str(out), "--dump-logits", str(dump)]
        res = CliRunner().invoke(app, args + flag)
        assert res.exit_code == 0, res.output
        outs.append((json.loads(out.read_text())["generated_ids"], dump.read_bytes()))
    assert outs[0] == outs[1]


def test_refuses_existing_directory(tiny):
    res = CliRunner().invoke(app, ["synth", str(tiny), "--size", "tiny"])
    assert res.exit_code == 2 and "--force" in res.output


def test_force_replaces_only_a_checkpoint_synth_wrote(tmp_path):
    """--force never deletes a directory of someone else's files, even one with a config."""
    mine = tmp_path / "mine"
    assert CliRunner().invoke(app, ["synth", str(mine), "--size", "tiny", "-q"]).exit_code == 0
    res = CliRunner().invoke(app, ["synth", str(mine), "--size", "tiny", "--force", "-q"])
    assert res.exit_code == 0, res.output
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    (theirs / "notes.txt").write_text("keep me")
    res = CliRunner().invoke(app, ["synth", str(theirs), "--size", "tiny", "--force"])
    assert res.exit_code == 3 and "k3 synth did not write" in res.output
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json", "notes.txt"]
    (mine / "notes.txt").write_text("added later")
    res = CliRunner().invoke(app, ["synth", str(mine), "--size", "tiny", "--force"])
    assert res.exit_code == 3 and (mine / "notes.txt").read_text() == "added later"


def test_set_with_a_misspelt_key_is_refused(tmp_path):
    out = tmp_path / "m"
    res = CliRunner().invoke(app, ["synth", str(out), "--set", "num_hiden_layers=5"])
    assert res.exit_code == 2
    assert "--set num_hiden_layers: not a config key" in res.output
    assert "did you mean 'num_hidden_layers'" in res.output
    assert not out.exists()


def test_set_with_a_known_key_applies(tmp_path):
    out = tmp_path / "m"
    res = CliRunner().invoke(app, ["synth", str(out), "--set", "num_hidden_layers=5",
                                   "--set", "full_attn_layers=[4,5]"])
    assert res.exit_code == 0, res.output
    assert load_config(out).n_layers == 5
