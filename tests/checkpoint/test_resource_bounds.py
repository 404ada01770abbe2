"""Buffers sized from file contents are checked before they are allocated.

A safetensors tensor must lie inside its file, but a file can be sparse: here a tensor
claims a terabyte, and its shard really is a terabyte long (a hole; nothing is written).
The config says how big every tensor may be, so the run refuses from the headers alone
(exit 1) instead of allocating. A memory plan that exceeds what the machine has is refused
before the checkpoint is even indexed, including a streamed trunk without ``--trunk-gb``
(every layer pinned) and a config that claims a model far larger than its files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

import k3core.run.memory_plan
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
TB = 1 << 40


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("bounds"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "m", ModelConfig.from_json_dict(size_config("tiny")), 6)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "t"
    assert runner.invoke(app, ["pack-trunk", str(model), str(out)]).exit_code == 0
    return out


def inflate(model: Path, work: Path, tag: str, name: str, shape: list[int]) -> Path:
    """A copy of ``model`` whose tensor ``name`` claims ``shape``, its bytes a sparse hole at
    the end of its shard (so every range check against the file size passes)."""
    dst = work / f"inflated-{tag}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(model, dst)
    with CheckpointIndex.open(dst, PlainStorage()) as idx:
        info = idx.info(name)
    shard = info.path
    blob = shard.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    itemsize = info.np_dtype.itemsize
    nbytes = itemsize
    for d in shape:
        nbytes *= d
    header[name] = {"dtype": info.dtype, "shape": shape,
                    "data_offsets": [len(data), len(data) + nbytes]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(shard, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw + data)
    try:
        os.truncate(shard, 8 + len(raw) + len(data) + nbytes)
    except OSError as exc:
        pytest.skip(f"this filesystem cannot hold a sparse {nbytes >> 40} TB file: {exc}")
    assert shard.stat().st_size > TB and shard.stat().st_blocks * 512 < 64 << 20
    return dst


def k3(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def refused(res, code: int, *needles: str) -> str:
    out = " ".join(res.output.split())
    assert isinstance(res.exception, SystemExit), f"escaped: {res.exception!r}\n{res.output}"
    assert res.exit_code == code, out
    for n in needles:
        assert n in out, (n, out)
    assert "weights bound" not in out and "generated ids" not in out
    return out


@pytest.mark.parametrize("streamed", [False, True])
def test_trunk_tensor_claiming_a_terabyte(model, trunk, work, streamed) -> None:
    name = names.layer_name(0, "self_attn.o_proj.weight")
    m = inflate(model, work, f"trunk-{streamed}", name, [1 << 20, 1 << 19])
    extra = ["--trunk", trunk] if streamed else []
    res = k3("run", m, "--ids", "3,7", "--gen", "1", *extra)
    refused(res, 1, "layer 0: self_attn.o_proj.weight has shape [1048576, 524288], expected [128,")
    pack = k3("pack-trunk", m, work / f"never-{streamed}")
    refused(pack, 1, "layer 0: self_attn.o_proj.weight has shape [1048576, 524288]")
    assert not (work / f"never-{streamed}").exists()


@pytest.mark.parametrize("ultra", [False, True])
def test_embedding_claiming_a_terabyte(model, trunk, work, ultra) -> None:
    m = inflate(model, work, f"embed-{ultra}", names.EMBED, [1 << 32, 128])
    extra = ["--trunk", trunk, "--ultra-low-memory"] if ultra else []
    res = k3("run", m, "--ids", "3,7", "--gen", "1", *extra)
    refused(res, 1, f"{names.EMBED} has shape [4294967296, 128], expected [1024, 128]")


def test_routed_expert_claiming_a_terabyte(model, work) -> None:
    name = names.expert_name(12, 0, "w1", "weight_packed")
    m = inflate(model, work, "expert", name, [1 << 20, 1 << 20])
    res = k3("run", m, "--ids", "3,7", "--gen", "1")
    out = " ".join(res.output.split())
    assert isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 1 and "routed expert 12/0: its tensors hold" in out, out
    assert "shapes disagree with the config" in out and "generated ids" not in out


def test_streamed_trunk_without_budget_is_planned(model, trunk, monkeypatch) -> None:
    """No --trunk-gb pins every layer: the plan counts them and refuses before indexing."""
    monkeypatch.setattr(k3core.run.memory_plan, "available_bytes", lambda: 20_000_000)
    res = k3("run", model, "--ids", "3,7", "--gen", "1", "--trunk", trunk)
    out = refused(res, 1, "REFUSING TO START", "trunk (STREAMED)")
    assert "indexed" not in out
    monkeypatch.undo()
    ok = k3("run", model, "--ids", "3,7", "--gen", "1", "--trunk", trunk)
    assert ok.exit_code == 0 and "trunk (STREAMED)" in ok.output, ok.output


def test_config_claiming_a_huge_model_is_refused_before_reading(model, work) -> None:
    m = work / "huge-config"
    shutil.rmtree(m, ignore_errors=True)
    shutil.copytree(model, m)
    conf = json.loads((m / "config.json").read_text())
    text = conf.get("text_config", conf)
    text["vocab_size"] = 2**31 - 1
    (m / "config.json").write_text(json.dumps(conf))
    res = k3("run", m, "--ids", "3,7", "--gen", "1")
    out = refused(res, 1, "REFUSING TO START", "embed + lm_head")
    assert "indexed" not in out
