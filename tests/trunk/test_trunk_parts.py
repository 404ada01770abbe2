"""Sub-layer streaming units: the split of each layer, the plan at the released shape, the
bits of a part-by-part bind, and the ring driven part by part."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError, K3Error, UsageError
from k3core.api.units import ALIGN
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.layer_params import prepare_layer, trunk_suffixes
from k3core.model.shapes import size_config
from k3core.run.presets import list_presets
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.tools.synth.writer import synthesize
from k3core.tools.trunk_plans import preset_trunk_plans
from k3core.trunk.bind import bind_matrices, bind_small
from k3core.trunk.crc import crc32_combine
from k3core.trunk.manifest import DATA_NAME, TrunkLayer, TrunkTensor, crc_tag, open_trunk
from k3core.trunk.parts import ATTN, MLP, WHOLE, shape_part_sizes, split_layer
from k3core.trunk.plan import plan_trunk
from k3core.trunk.stream import StreamedTrunk

runner = CliRunner()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("parts"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "small", ModelConfig.from_json_dict(size_config("small")), 3)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(model), str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def opened(model, trunk):
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        yield cfg, idx, open_trunk(trunk, idx, cfg)


# ---- the plan at the released shape (no data) -----------------------------------------------
def test_real_shape_laptop_gets_two_slots_of_the_largest_part() -> None:
    cfg = ModelConfig.from_json_dict(size_config("real"))
    units = shape_part_sizes(cfg)
    whole = shape_part_sizes(cfg, split=False)
    assert len(units) == 2 * cfg.n_layers and len(whole) == cfg.n_layers
    largest_part, largest_layer = max(n for _, n in units), max(n for _, n in whole)
    assert largest_part < 0.7 * largest_layer  # dense layer 0's MLP, not the whole layer
    plans = {p.preset: p for p in preset_trunk_plans(cfg, list_presets(on_error=lambda e: None))}
    laptop = plans["laptop"]
    assert laptop.plan is not None and laptop.plan.ring >= 2 and laptop.overlaps
    assert laptop.plan.slot_bytes == largest_part
    # by whole layers the same budget holds one slot, so nothing could overlap
    assert plan_trunk([n for _, n in whole], laptop.budget_bytes).ring == 1
    for tp in plans.values():  # every preset above the floor fits and covers every unit
        if tp.plan is not None:
            assert tp.plan.planned_bytes <= tp.budget_bytes
            assert all(tp.plan.sizes[i] <= tp.plan.slot_bytes for i in tp.plan.streamed)


def test_real_shape_overlaps_with_two_unequal_slots_below_two_equal_ones() -> None:
    cfg = ModelConfig.from_json_dict(size_config("real"))
    sizes = [n for _, n in shape_part_sizes(cfg)]
    big = max(sizes)
    plans = {p.preset: p for p in preset_trunk_plans(cfg, list_presets(on_error=lambda e: None))}
    ultra = plans["ultra"].plan  # 2.5 GB: two slots of the largest part do not fit
    assert ultra is not None and ultra.ring == 2 and ultra.slot_sizes[0] == big
    assert 0 < ultra.small_slot_bytes < big and plans["ultra"].overlaps
    assert plan_trunk(sizes, plans["ultra"].budget_bytes).ring == 1  # equal slots: one
    smallest_pair = big + min(sizes)
    for budget in range(smallest_pair, 2 * big, 50_000_000):
        p = plan_trunk(sizes, budget, small_slot=True)
        assert p.ring == 2 and p.planned_bytes <= budget, budget
        assert all(p.sizes[i] <= p.slot_bytes for i in p.streamed)
    assert plan_trunk(sizes, big, small_slot=True).ring == 1  # the floor itself: one slot


def test_shape_parts_bound_the_packed_parts(opened) -> None:
    cfg, _, man = opened
    planned = dict(shape_part_sizes(cfg))
    for lay in man.layers:
        for part in split_layer(lay).parts:
            assert part.name in (ATTN, MLP)
            assert part.nbytes <= planned[part.label]  # the shape plan never underestimates


def test_budget_shape_real_prints_the_plan_and_refuses_bad_input() -> None:
    res = runner.invoke(app, ["budget", "--shape", "real"])
    assert res.exit_code == 0, res.output
    line = next(s for s in res.output.splitlines() if s.strip().startswith("laptop"))
    assert "2 x 1.45 GB" in line and "read ahead (overlap)" in line
    assert "186 parts" in res.output
    bad = runner.invoke(app, ["budget", "--shape", "huge"])
    assert bad.exit_code == 2 and "--shape must be one of" in bad.output
    both = runner.invoke(app, ["budget", "somewhere", "--shape", "real"])
    assert both.exit_code == 2 and "not both" in both.output


# ---- the split of one layer ------------------------------------------------------------------
def test_every_layer_splits_into_two_aligned_parts_covering_every_tensor(opened) -> None:
    cfg, _, man = opened
    for lay in man.layers:
        sp = split_layer(lay)
        assert [p.name for p in sp.parts] == [ATTN, MLP] or [p.name for p in sp.parts] == [MLP, ATTN]
        for p in sp.parts:
            assert p.start % ALIGN == 0 and p.nbytes % ALIGN == 0 and p.end <= lay.nbytes
        got = sorted([s for p in sp.parts for s in p.matrices] + list(sp.small))
        assert got == sorted(trunk_suffixes(cfg, lay.layer))
        # segments partition the run, each inside its owner
        assert sp.segments[0].start == 0 and sp.segments[-1].end == lay.span
        for a, b in zip(sp.segments, sp.segments[1:], strict=False):
            assert a.end == b.start
        for s in sp.segments:
            if s.owner >= 0:
                assert sp.parts[s.owner].start <= s.start and s.end <= sp.parts[s.owner].end
            else:
                assert any(r0 <= s.start and s.end <= r1 for r0, r1 in sp.resident)


def test_segment_crcs_combine_to_the_layer_checksum(opened, trunk) -> None:
    _, _, man = opened
    data = (trunk / DATA_NAME).read_bytes()
    for lay in man.layers:
        run = data[lay.file_off : lay.file_off + lay.span]
        crc = 0
        for s in split_layer(lay).segments:
            crc = crc32_combine(crc, zlib.crc32(run[s.start : s.end]), s.end - s.start)
        assert crc_tag(crc) == lay.checksum


def test_interleaved_layout_stays_one_part() -> None:
    def t(name: str, off: int, n: int, shape: tuple[int, ...]) -> TrunkTensor:
        return TrunkTensor(names.layer_name(1, name), off, n, "BF16", shape)

    a, m = "self_attn.o_proj.weight", "block_sparse_moe.routed_expert_up_proj.weight"
    tensors = {x.name: x for x in (t(a, 0, 8192, (64, 64)), t(m, 8192, 8192, (64, 64)),
                                   t("self_attn.q_proj.weight", 16384, 8192, (64, 64)))}
    lay = TrunkLayer(1, 0, 24576, 24576, "crc32:00000000", tensors)
    sp = split_layer(lay)
    assert [p.name for p in sp.parts] == [WHOLE] and sp.parts[0].nbytes == 24576
    assert [p.name for p in split_layer(lay, split=False).parts] == [WHOLE]


def test_part_by_part_bind_equals_prepare_layer_bits(opened) -> None:
    cfg, idx, man = opened
    for L in range(cfg.n_layers):
        raw = {s: idx.read(names.layer_name(L, s)) for s in trunk_suffixes(cfg, L)}
        want = prepare_layer(cfg, L, raw).t
        sp = split_layer(man.layers[L])
        got = bind_small(cfg, L, {s: raw[s] for s in sp.small})
        for p in sp.parts:
            got.update(bind_matrices(cfg, L, {s: raw[s] for s in p.matrices}))
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), k


def test_bind_refuses_a_wrong_shape(opened) -> None:
    cfg, idx, _ = opened
    w = idx.read(names.layer_name(1, "self_attn.o_proj.weight"))
    with pytest.raises(CheckpointError, match="o_proj.weight has shape"):
        bind_matrices(cfg, 1, {"self_attn.o_proj.weight": w[:, :-1]})


# ---- the ring, part by part -----------------------------------------------------------------
def _walk(tr: StreamedTrunk, cfg: ModelConfig, idx: CheckpointIndex, check: bool = True) -> None:
    for L in range(cfg.n_layers):
        p = tr.acquire(L)
        sp = tr.splits[L]
        first, second = sp.parts[0], sp.parts[-1]
        for s in first.matrices:
            if check:
                assert np.asarray(p[s]).tobytes() == idx.read(names.layer_name(L, s)).tobytes()
        tr.begin_mlp(L)
        if len(sp.parts) > 1:
            assert all(s not in p.t for s in first.matrices)  # dead views are dropped
        for s in second.matrices:
            if check:
                assert np.asarray(p[s]).tobytes() == idx.read(names.layer_name(L, s)).tobytes()
        tr.release(L)


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_parts_serve_the_checkpoint_bytes_at_any_budget(opened, ring, share) -> None:
    cfg, idx, man = opened
    probe = StreamedTrunk(cfg, man, PlainStorage(), man.total_bytes, split=True)
    sizes = [u.nbytes for u in probe.units]
    probe.close()
    budget = ring * max(sizes) + int(share * sum(sizes))
    tr = StreamedTrunk(cfg, man, PlainStorage(), budget, ring=ring, split=True)
    try:
        assert tr.plan.sizes == tuple(sizes) and len(sizes) == 2 * cfg.n_layers
        for _ in range(2):
            _walk(tr, cfg, idx)
        assert tr.stats.binds == 2 * 2 * cfg.n_layers
        assert tr.stats.verified == cfg.n_layers and tr.held_layers() == []
    finally:
        tr.close()


def test_unequal_slots_serve_the_checkpoint_bytes(opened) -> None:
    cfg, idx, man = opened
    probe = StreamedTrunk(cfg, man, PlainStorage(), man.total_bytes, split=True)
    sizes = [u.nbytes for u in probe.units]
    probe.close()
    big = max(sizes)
    small = max(n for n in sizes if n < big)
    tr = StreamedTrunk(cfg, man, PlainStorage(), big + small, split=True)
    try:
        assert tr.plan.slot_sizes == (big, small) and tr.has_reader
        assert all(s.buf.nbytes >= n for s, n in zip(tr.slots, (big, small), strict=True))
        for _ in range(3):
            _walk(tr, cfg, idx)
        assert tr.held_layers() == [] and tr.stats.failed_reads == 0
    finally:
        tr.close()


def test_begin_mlp_before_acquire_and_twice_acquired_are_refused(opened) -> None:
    cfg, _, man = opened
    tr = StreamedTrunk(cfg, man, PlainStorage(), man.total_bytes, split=True)
    try:
        with pytest.raises(K3Error, match="before acquire"):
            tr.begin_mlp(0)
        tr.acquire(0)
        with pytest.raises(K3Error, match="acquired twice"):
            tr.acquire(0)
        tr.release(0)
        with pytest.raises(K3Error, match="not part of this run's walk"):
            tr.acquire(cfg.n_layers)
    finally:
        tr.close()


def test_a_damaged_mlp_part_is_refused_before_the_attention_part_is_served(opened, work, trunk):
    import shutil

    cfg, idx, _ = opened
    d = work / "damaged-mlp"
    shutil.copytree(trunk, d)
    man = open_trunk(d, idx, cfg)
    L = 2
    lay = man.layers[L]
    sp = split_layer(lay)
    mlp = sp.parts[sp.part_index(MLP)]
    with open(d / DATA_NAME, "r+b") as f:  # one byte inside the MLP matrices
        f.seek(lay.file_off + mlp.start + mlp.nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    for ring in (1, 2):
        budget = ring * max(u.nbytes for s in map(split_layer, man.layers) for u in s.parts)
        tr = StreamedTrunk(cfg, man, PlainStorage(), budget, ring=ring, split=True)
        try:
            for k in range(L):
                tr.acquire(k)
                tr.begin_mlp(k)
                tr.release(k)
            with pytest.raises(CheckpointError, match=f"layer {L} fails its checksum"):
                tr.acquire(L)  # the attention part is fine, but its layer is not
            assert tr.held_layers() == []
        finally:
            tr.close()


def test_floor_refusal_names_the_largest_part(opened) -> None:
    cfg, _, man = opened
    with pytest.raises(UsageError, match="largest streaming unit"):
        StreamedTrunk(cfg, man, PlainStorage(), ALIGN, split=True)
