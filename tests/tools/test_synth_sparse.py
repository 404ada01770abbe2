"""``k3 synth --sparse``: the released shapes, dtypes and headers, holes for data, a pattern
that keeps routing alive; a filesystem without holes is refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.checkpoint.index import CheckpointIndex
from k3core.checkpoint.safetensors_header import header_length, parse_header
from k3core.cli.app import app
from k3core.experts.trace import read_trace
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.layer_params import expected_shapes, trunk_suffixes
from k3core.model.shapes import size_config
from k3core.model.sizes import planned_tensor_bytes, sizes_from_config, sizes_from_index
from k3core.tools.synth import sparse

FULL = ModelConfig.from_json_dict(size_config("real"), source="released")


def k3(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def allocated(d):
    return sum(p.stat().st_blocks * 512 for p in d.iterdir())


def logical(d):
    return sum(p.stat().st_size for p in d.iterdir())


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse") / "medium"
    res = k3("synth", out, "--size", "medium", "--sparse", "--seed", "4")
    assert res.exit_code == 0, res.output
    return out


def test_full_shape_tensors_are_the_released_ones(tmp_path) -> None:
    """Every tensor's name, shape and dtype at the released shape, and the census totals:
    trunk 108,811,877,376 B, tables 4,697,663,488 B, 17,547,264 B per expert,
    metadata.total_size 1,560,860,324,864 with the vision stand-ins, 497,220 tensors."""
    total, count, trunk = 0, 0, 0
    for L in range(FULL.n_layers):
        ts = sparse.layer_tensors(FULL, 0, L)
        by = {t.name: t for t in ts}
        shapes = expected_shapes(FULL, L)
        for s in trunk_suffixes(FULL, L):
            t = by[names.layer_name(L, s)]
            if s in shapes:
                assert t.shape == shapes[s]
            assert t.nbytes == planned_tensor_bytes(s, t.shape)
            trunk += t.nbytes
        if L in (0, 1, 3):
            if not FULL.is_dense(L):
                p = by[names.expert_name(L, 895, "w2", "weight_packed")]
                assert (p.dtype, p.shape) == ("U8", (3584, 1536))
                assert by[names.expert_name(L, 7, "w1", "weight_scale")].shape == (3072, 112)
            if not FULL.is_mla(L):
                assert by[names.layer_name(L, "self_attn.A_log")].shape == (128,)
                assert by[names.layer_name(L, "self_attn.q_conv1d.weight")].dtype == "F32"
            assert by[names.layer_name(L, "input_layernorm.weight")].dtype == "BF16"
        total += sum(t.nbytes for t in ts)
        count += len(ts)
    tables = sparse.table_tensors(FULL, 0)
    vision = [t for shard in sparse.vision_shards() for t in shard]
    total += sum(t.nbytes for t in tables + vision)
    count += len(tables) + len(vision)
    assert trunk == sizes_from_config(FULL).trunk_bytes == 108_811_877_376
    assert sum(t.nbytes for t in tables) == 4_697_663_488
    assert sum(t.nbytes for t in vision) == 894_717_952 and len(vision) == 168
    assert total == 1_560_860_324_864 and count == 497_220


def test_full_shape_shard_is_a_sparse_safetensors_file(tmp_path) -> None:
    """One released layer shard (17 GB logical) written for real: the header parses with
    k3's checker, the trunk is one run before the experts, each expert's six tensors are
    contiguous in w1, w2, w3 order, and it takes about a megabyte of disk."""
    path = tmp_path / "model-00002-of-00096.safetensors"
    ts = sparse.layer_tensors(FULL, 0, 1)
    data = sparse.write_sparse_shard(path, ts)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
    n = header_length(raw, size, path)
    with open(path, "rb") as f:
        f.seek(8)
        entries = parse_header(f.read(n), size - 8 - n, path)
    assert size == 8 + n + data and (8 + n) % 8 == 0
    assert len(entries) == len(trunk_suffixes(FULL, 1)) + 896 * 6
    order = sorted(entries, key=lambda e: e.begin)
    n_trunk = len(trunk_suffixes(FULL, 1))
    assert all(not names.EXPERT_RE.match(names.split_layer_name(e.name)[1]) for e in order[:n_trunk])
    first = [e.name.rsplit(".", 3)[-3:] for e in order[n_trunk : n_trunk + 6]]
    assert first == [["0", w, f] for w in ("w1", "w2", "w3")
                     for f in ("weight_packed", "weight_scale")]
    assert size > 16e9 and path.stat().st_blocks * 512 < 4e6


def test_medium_sparse_is_small_on_disk_and_indexes(medium) -> None:
    cfg = load_config(medium)
    idx = json.loads((medium / "model.safetensors.index.json").read_text())
    with CheckpointIndex.open(medium, PlainStorage()) as index:
        sz = sizes_from_index(cfg, {n: index.info(n).nbytes for n in index})
        assert set(idx["weight_map"]) == set(index)
        assert index.info(names.EMBED).dtype == "BF16"
        assert index.info(names.layer_name(1, "input_layernorm.weight")).dtype == "BF16"
        norm = index.read(names.layer_name(1, "input_layernorm.weight"))
        assert (norm == 0x3F80).all()  # norms are 1
        gate = index.read(names.layer_name(1, "block_sparse_moe.gate.weight"))
        live = sparse.live_router_rows(cfg, 4, 1)
        assert sorted(np.flatnonzero(gate.any(axis=1))) == live
    assert sz.trunk_bytes == sizes_from_config(cfg).trunk_bytes
    assert idx["metadata"]["total_size"] == sum(index_sizes(medium))
    assert logical(medium) > 2e9 and allocated(medium) < 20e6
    assert (medium / "tiktoken.model").exists() and (medium / "tokenizer_config.json").exists()


def index_sizes(d):
    with CheckpointIndex.open(d, PlainStorage()) as index:
        return [index.info(n).nbytes for n in index]


def test_same_seed_same_bytes_other_seed_other_pattern(medium, tmp_path) -> None:
    again = tmp_path / "again"
    assert k3("synth", again, "--size", "medium", "--sparse", "--seed", "4").exit_code == 0
    shard = "model-00002-of-00026.safetensors"
    assert (again / shard).read_bytes() == (medium / shard).read_bytes()
    other = tmp_path / "other"
    assert k3("synth", other, "--size", "medium", "--sparse", "--seed", "5").exit_code == 0
    assert (other / shard).read_bytes() != (medium / shard).read_bytes()


@pytest.mark.slow
def test_it_runs_finite_and_routing_varies(medium, tmp_path) -> None:
    out, traces = tmp_path / "run.json", tmp_path / "traces"
    traces.mkdir()
    res = k3("run", medium, "--ids", "1,2,3,200", "--gen", "2", "--out", out,
             "--dump-cache-trace", traces)
    assert res.exit_code == 0, res.output
    cfg = load_config(medium)
    pairs = read_trace(traces / "expert_trace.bin")
    k, n_moe = cfg.topk, cfg.n_layers - 1
    # prefill of 4 positions (the last layer's MoE only for the last one, whose logits are
    # asked: k3core/model/forward.py), then one decode step
    assert len(pairs) == (4 * (n_moe - 1) + 1 + n_moe) * k
    pre = pairs[: 4 * (n_moe - 1) * k].reshape(n_moe - 1, 4, k, 2)  # per layer: positions x top-k
    sets = [[frozenset(pre[L, p, :, 1].tolist()) for p in range(4)] for L in range(n_moe - 1)]
    assert all(len(set(row)) > 1 for row in sets)  # every layer routes tokens differently
    assert len({row[0] for row in sets}) > n_moe // 2  # and layers differ from each other
    rep = json.loads(out.read_text())
    assert len(rep["generated_ids"]) == 2 and all(0 <= i < cfg.vocab for i in rep["generated_ids"])


def test_refuses_a_filesystem_without_holes(tmp_path, monkeypatch) -> None:
    """Where st_blocks shows the probe stored in full, --sparse stops before writing a shard."""
    monkeypatch.setattr(sparse, "allocated_bytes", lambda p: os.stat(p).st_size)
    res = k3("synth", tmp_path / "m", "--size", "medium", "--sparse")
    assert res.exit_code == 3
    assert "does not keep holes" in res.output
    assert list(tmp_path.iterdir()) == []


def test_full_needs_sparse(tmp_path) -> None:
    res = k3("synth", tmp_path / "m", "--size", "full")
    assert res.exit_code == 2 and "--sparse" in res.output
    assert not (tmp_path / "m").exists()
