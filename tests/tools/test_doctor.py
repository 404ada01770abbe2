"""``k3 doctor``: a complete synthetic model passes and names the next command (run it
resident when it fits whole, else pack the trunk and run the preset that fits); an
incomplete one, or a machine too small for even the ultra floor, exits 1 naming what is
wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.names import expert_name, layer_name
from k3core.model.shapes import size_config
from k3core.tools.doctor.machine import GIB, cpu_flags, run_doctor
from k3core.tools.synth.writer import synthesize, write_shard

runner = CliRunner()
FAST = ["--probe-mb", "1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor") / "tiny"
    return synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), 5)


@pytest.fixture
def copy(model, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(model, dst)
    return dst


def drop_tensor(model_dir, name):
    """Rewrite the shard holding ``name`` without it, and the index without its entry."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = model_dir / index["weight_map"].pop(name)
    with CheckpointIndex.open(model_dir, PlainStorage()) as idx:
        keep = sorted((t for t in idx.tensors.values() if t.path == shard and t.name != name),
                      key=lambda t: t.offset)
        tensors = {t.name: idx.read(t.name) for t in keep}
    write_shard(shard, tensors)
    index_path.write_text(json.dumps(index))


def test_complete_model_passes_and_names_the_next_command(model):
    res = runner.invoke(app, ["doctor", str(model), *FAST])
    assert res.exit_code == 0, res.output
    assert "result: ready" in res.output
    # the tiny model fits whole in this machine's memory: run it resident, pack nothing
    assert "pack-trunk" not in res.output and "the whole of this model fits" in res.output
    run_line = next(ln for ln in res.output.splitlines() if "k3 run" in ln)
    assert "--trunk" not in run_line and "--preset" not in run_line
    assert "--tok" in run_line and "--prompt" in run_line  # synth writes a tokenizer
    for section in ("toolchain", "plugins", "cpu", "memory", "model", "disk", "fit"):
        assert f"\n{section}\n" in res.output
    assert "all 96 routed experts present" in res.output


def test_a_model_that_does_not_fit_whole_is_told_to_pack_its_trunk(model):
    r = run_doctor(model, disk_probe=False, available=60_000_000, total=120_000_000,
                   baseline=40_000_000)
    assert r.exit_code == 0 and r.verdict is not None and not r.verdict.resident
    assert r.next_commands[0] == f"k3 pack-trunk {model} {model}-trunk"
    assert f"--trunk {model}-trunk --preset {r.preset} " in r.next_commands[1]
    assert "--incremental" in r.next_commands[1]


def test_tokenizer_present_gives_a_prompt_command(copy):
    (copy / "tiktoken.model").write_bytes(b"")
    (copy / "tokenizer_config.json").write_text("{}")
    r = run_doctor(copy, disk_probe=False)
    assert r.exit_code == 0
    assert f"--tok {copy} --prompt 'The capital of France is'" in r.next_commands[-1]


def test_missing_shard_fails_naming_it(copy):
    victim = "model-00004-of-00014.safetensors"
    (copy / victim).unlink()
    res = runner.invoke(app, ["doctor", str(copy), *FAST])
    assert res.exit_code == 1, res.output
    assert "missing 1 of 14 shards" in res.output and victim in res.output
    assert "k3 run" not in res.output and "blocking problem" in res.output


def test_missing_expert_and_trunk_tensors_are_named(copy):
    drop_tensor(copy, expert_name(5, 3, "w2", "weight_scale"))
    drop_tensor(copy, layer_name(2, "self_attn.q_proj.weight"))
    r = run_doctor(copy, disk_probe=False)
    assert r.exit_code == 1
    fails = {c.name: c.detail for c in r.checks if c.status == "fail"}
    assert "layer 5 expert 3" in fails["experts"] and "1 of 96" in fails["experts"]
    assert "layers.2.self_attn.q_proj.weight" in fails["trunk"]


def test_unreadable_config_fails(copy):
    (copy / "config.json").write_text("{not json")
    res = runner.invoke(app, ["doctor", str(copy), "--no-disk-probe"])
    assert res.exit_code == 1 and "config" in res.output


def test_machine_too_small_for_the_ultra_floor(model):
    r = run_doctor(model, disk_probe=False, available=10_000_000, total=20_000_000,
                   baseline=50_000_000)
    assert r.exit_code == 1
    fail = next(c for c in r.checks if c.status == "fail")
    assert fail.name == "ultra floor" and "cannot run this model" in fail.detail
    assert not r.next_commands


def test_injected_disk_measure_and_memory_mapping(model):
    seen = []

    def measure(path):
        seen.append(path)
        return [("direct", 1, 900.0), ("direct", 16, 3200.0), ("buffered", 1, 700.0)]

    r = run_doctor(model, measure=measure, available=40 * GIB, total=64 * GIB,
                   baseline=50_000_000)
    assert r.exit_code == 0 and r.preset is None and r.to_json()["resident"]
    assert seen and seen[0].suffix == ".safetensors"  # the largest shard, read not written
    details = {c.name: c.detail for c in r.checks}
    assert details["read direct QD16"].startswith("3,200 MB/s")


def test_no_model_dir_writes_and_removes_a_probe_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the baseline given: the plan's "python + libraries" row is this process's resident set,
    # which in a long test run can be large enough to push the ultra plan past 4 GiB
    r = run_doctor(None, probe_bytes=1 << 20, available=4 * GIB, total=8 * GIB,
                   baseline=50_000_000)
    assert r.exit_code == 0 and r.preset == "ultra"
    assert any(c.name == "preset" and c.status == "warn" for c in r.checks)
    assert list(tmp_path.iterdir()) == []


def test_cpu_flags_parser(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n\nprocessor\t: 1\n")
    assert {"avx2", "fma"} <= (cpu_flags(str(f)) or set())
    assert cpu_flags(str(tmp_path / "none")) is None

