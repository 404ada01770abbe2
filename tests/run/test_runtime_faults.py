"""Faults while ``k3 run`` works: files truncated under it, reads that fail.

Each case goes through the real command line and checks the exit code from
``docs/exit-codes.md``, the one-line message, that no traceback escaped, and that the
``--out`` file was not written (so nothing half-made is left for a later run to accept).
Truncations are real (``os.truncate`` on the file the run has open); failed reads come from
the ``faulty`` storage backend wrapped around a real one (``K3_FAULT_*``). A streamed
trunk failing mid-run through the storage interface is covered in ``test_trunk_faults.py``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

import k3core.run.binding
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.session import Session
from k3core.testing.faulty_backend import (
    available_storage,
    disk_backed_dir,
    env,
    register_faulty,
    unregister_faulty,
)
from k3core.tools.synth.writer import synthesize
from k3core.trunk.manifest import DATA_NAME

runner = CliRunner()
SHORT = ("short read", "outside the file", "shrank", "end of file", "past the end")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("runtime-faults"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "model", ModelConfig.from_json_dict(size_config("tiny")), 3)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "trunk"
    assert runner.invoke(app, ["pack-trunk", str(model), str(out)]).exit_code == 0
    return out


@pytest.fixture(scope="module")
def layout(model) -> dict[str, Any]:
    """Shard names and byte ranges the faults aim at."""
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        last = idx.info(names.EMBED).path.name
        moe = 12
        shard = idx.info(names.layer_name(moe, "input_layernorm.weight")).path
        experts = [t for t in idx.tensors.values() if t.path == shard and ".experts." in t.name]
        trunk = [t for t in idx.tensors.values() if t.path == shard and ".experts." not in t.name]
        emb, head = idx.info(names.EMBED), idx.info(names.LM_HEAD)
        return {
            "tables_shard": last,
            "moe_layer": moe,
            "moe_shard": shard.name,
            "experts_from": min(t.offset for t in experts),
            "trunk_end": max(t.offset + t.nbytes for t in trunk),
            "experts_to": max(t.offset + t.nbytes for t in experts),
            "bind_shard": idx.info(names.layer_name(3, "input_layernorm.weight")).path.name,
            "embed": (emb.offset, emb.offset + emb.nbytes),
            "head": (head.offset, head.offset + head.nbytes),
        }


@pytest.fixture
def faulty(monkeypatch):
    register_faulty()
    for k in ("AFTER", "RANGE", "MATCH", "INNER"):
        monkeypatch.delenv(f"K3_FAULT_{k}", raising=False)
    yield lambda **kw: [monkeypatch.setenv(k, v) for k, v in env(inner="plain", **kw).items()]
    unregister_faulty()


def _copy(model: Path, work: Path, tag: str) -> Path:
    dst = work / f"copy-{tag}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(model, dst)
    return dst


def k3(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def refused(res, code: int, *needles: str, any_of: tuple[str, ...] = ()) -> str:
    """The refusal shape every case must have; returns the flattened output."""
    out = " ".join(res.output.split())
    assert isinstance(res.exception, SystemExit), f"escaped: {res.exception!r}\n{res.output}"
    assert res.exit_code == code, out
    assert "Traceback" not in res.output and "k3: error:" in out
    for n in needles:
        assert n in out, (n, out)
    if any_of:
        assert any(n in out for n in any_of), (any_of, out)
    assert "generated ids" not in out
    return out


def _outs(d: Path) -> list[str]:
    d.mkdir(exist_ok=True)
    return ["--out", str(d / "run.json"), "--dump-logits", str(d / "logits.bin")]


def _nothing_left(d: Path) -> None:
    assert sorted(p.name for p in d.iterdir()) == [], sorted(p.name for p in d.iterdir())


def _with_before_step(monkeypatch, hook: Callable[[int], None]) -> None:
    """Make ``k3 run``'s decode loop call ``hook(step)`` before each step (fault timing)."""

    def before_step(self: Session, step: int) -> None:
        hook(step)

    monkeypatch.setattr(Session, "before_step", before_step)


# ---- files truncated while the run holds them open ------------------------------------------
@pytest.mark.parametrize("storage", available_storage())
def test_shard_truncated_between_index_and_binding(model, work, layout, monkeypatch,
                                                   storage) -> None:
    """Resident trunk: the headers were read and checked, then layer 3's shard is cut in
    half before its tensors are bound."""
    m = _copy(model, work, f"bind-{storage}")
    shard = m / layout["bind_shard"]
    real = CheckpointIndex.open

    class Truncating(CheckpointIndex):
        @classmethod
        def open(cls, model_dir: Any, storage: Any) -> CheckpointIndex:
            idx = real(model_dir, storage)
            os.truncate(shard, shard.stat().st_size // 2)
            return idx

    monkeypatch.setattr(k3core.run.binding, "CheckpointIndex", Truncating)
    out = work / f"out-bind-{storage}"
    res = k3("run", m, "--ids", "3,7", "--gen", "2", "--storage", storage, *_outs(out))
    refused(res, 1, "language_model.model.layers.3.", any_of=SHORT)
    _nothing_left(out)
    monkeypatch.undo()
    later = k3("run", m, "--ids", "3,7", "--gen", "1", "--storage", storage)
    refused(later, 1, layout["bind_shard"], "truncated or damaged")  # never accepted later


@pytest.mark.parametrize("storage", available_storage())
def test_trunk_bin_truncated_mid_run(model, trunk, work, monkeypatch, storage) -> None:
    """Streamed trunk with a reader thread: trunk.bin loses its second half after step 0."""
    t = work / f"trunk-cut-{storage}"
    shutil.rmtree(t, ignore_errors=True)
    shutil.copytree(trunk, t)
    size = (t / DATA_NAME).stat().st_size

    def cut(step: int) -> None:
        if step == 1:
            os.truncate(t / DATA_NAME, size // 2)

    _with_before_step(monkeypatch, cut)
    out = work / f"out-trunk-{storage}"
    res = k3("run", model, "--ids", "3,7", "--gen", "3", "--trunk", t, "--trunk-gb", "0.0005",
             "--storage", storage, *_outs(out))
    refused(res, 1, "trunk layer", any_of=SHORT)
    _nothing_left(out)
    monkeypatch.undo()
    later = k3("run", model, "--ids", "3", "--gen", "1", "--trunk", t)
    refused(later, 1, "truncated or replaced, repack the trunk")


@pytest.mark.parametrize("storage", available_storage())
def test_files_replaced_mid_run_change_nothing(model, trunk, work, monkeypatch, storage) -> None:
    """Replacing a file (rename over it) while a run holds it open changes nothing: every
    read comes from the file the run opened and checked. The next run sees the new files
    and refuses them."""
    m = _copy(model, work, f"replaced-{storage}")
    t = work / f"trunk-replaced-{storage}"
    shutil.rmtree(t, ignore_errors=True)
    shutil.copytree(trunk, t)
    args = ["--ids", "3,7", "--gen", "3", "--trunk", t, "--trunk-gb", "0.0005", "--storage",
            storage]
    before = k3("run", m, *args)
    assert before.exit_code == 0, before.output
    shards = sorted(m.glob("*.safetensors"))

    def swap(step: int) -> None:
        if step == 1:
            for p in [t / DATA_NAME, *shards]:
                junk = p.with_name(p.name + ".new")
                junk.write_bytes(os.urandom(p.stat().st_size))
                os.replace(junk, p)

    _with_before_step(monkeypatch, swap)
    during = k3("run", m, *args)
    assert during.exit_code == 0, during.output
    ids = [line for line in during.output.splitlines() if line.startswith("generated ids")]
    assert ids and ids == [line for line in before.output.splitlines()
                           if line.startswith("generated ids")]
    monkeypatch.undo()
    later = k3("run", m, *args)
    refused(later, 1, "safetensors")


@pytest.mark.parametrize("storage", available_storage())
def test_expert_shard_truncated_after_open(model, work, layout, monkeypatch, storage) -> None:
    """Routed experts are read on first use: their bytes vanish after the trunk was bound.
    A routed expert that cannot be read is a drop: exit 4, never a partial MoE sum."""
    m = _copy(model, work, f"experts-{storage}")
    assert layout["experts_from"] >= layout["trunk_end"]

    def cut(step: int) -> None:
        if step == 0:
            os.truncate(m / layout["moe_shard"], layout["experts_from"])

    _with_before_step(monkeypatch, cut)
    out = work / f"out-experts-{storage}"
    res = k3("run", m, "--ids", "3,7", "--gen", "2", "--storage", storage, *_outs(out))
    refused(res, 4, f"routed expert {layout['moe_layer']}/", "refusing a partial MoE sum",
            any_of=SHORT)
    _nothing_left(out)


# ---- reads that fail, injected through the storage interface ----------------------------------
def test_failed_read_while_binding(model, work, layout, faulty) -> None:
    faulty(match=layout["bind_shard"], after=2)  # the two header reads pass, binding fails
    out = work / "out-faulty-bind"
    res = k3("run", model, "--ids", "3,7", "--gen", "2", "--storage", "faulty", *_outs(out))
    refused(res, 1, "language_model.model.layers.3.", "injected read failure")
    _nothing_left(out)


def test_failed_header_read_at_open(model, work, layout, faulty) -> None:
    faulty(match=layout["bind_shard"], after=1)
    res = k3("run", model, "--ids", "3,7", "--gen", "2", "--storage", "faulty")
    refused(res, 1, layout["bind_shard"], "cannot read the header", "injected read failure")


@pytest.mark.parametrize("streamed", [False, True])
def test_failed_expert_read(model, trunk, work, layout, faulty, streamed) -> None:
    faulty(match=layout["moe_shard"], range=f"{layout['experts_from']}:{layout['experts_to']}")
    out = work / f"out-faulty-experts-{streamed}"
    extra = ["--trunk", trunk, "--trunk-gb", "0.0005"] if streamed else []
    res = k3("run", model, "--ids", "3,7", "--gen", "2", "--storage", "faulty", *extra,
             *_outs(out))
    refused(res, 4, f"routed expert {layout['moe_layer']}/", "injected read failure",
            "refusing a partial MoE sum")
    _nothing_left(out)


@pytest.mark.parametrize("table, needle", [
    ("embed", "embedding row load failed for token 3 at position 0"),
    ("head", "lm_head rows 0.."),
])
def test_failed_table_read_ultra_low_memory(model, trunk, work, layout, faulty, table,
                                           needle) -> None:
    lo, hi = layout[table]
    faulty(match=layout["tables_shard"], range=f"{lo}:{hi}")
    out = work / f"out-faulty-{table}"
    res = k3("run", model, "--ids", "3,7", "--gen", "2", "--storage", "faulty", "--trunk", trunk,
             "--ultra-low-memory", *_outs(out))
    refused(res, 1, needle, "injected read failure")
    _nothing_left(out)
