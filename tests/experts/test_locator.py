"""The expert locator: one check per slot layout, views that match the checked ones, and a
layout that fails its check refused for every expert that has it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from k3_storage.plain import PlainStorage

from k3core.api.errors import CheckpointError
from k3core.api.kernels import Mxfp4
from k3core.checkpoint.index import CheckpointIndex
from k3core.experts.locator import ExpertLocator, ExpertRef
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.disk import disk_tmpdir
from k3core.tools.synth.writer import synthesize


@pytest.fixture(scope="module")
def located():
    with disk_tmpdir("k3-locator-") as d:
        cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 16}))
        model = synthesize(Path(d) / "tiny16", cfg, 5)
        with CheckpointIndex.open(model, PlainStorage()) as index:
            yield cfg, ExpertLocator(cfg, index)


def _moe_layers(cfg: ModelConfig) -> list[int]:
    return [L for L in range(cfg.n_layers) if not cfg.is_dense(L)]


def _same(a: Mxfp4 | np.ndarray, b: Mxfp4 | np.ndarray) -> bool:
    if isinstance(a, Mxfp4):
        assert isinstance(b, Mxfp4)
        return _same(a.packed, b.packed) and _same(a.scales, b.scales)
    assert isinstance(b, np.ndarray)
    return (a.shape == b.shape and a.dtype == b.dtype and a.flags.c_contiguous
            and np.shares_memory(a, b) and np.array_equal(a, b))


def test_one_check_per_layout_and_views_match_the_checked_ones(located) -> None:
    cfg, loc = located
    refs = [loc.ref(L, e) for L in _moe_layers(cfg) for e in range(cfg.n_experts)]
    assert len({r.layout for r in refs}) == len(loc._plans) == 1  # every expert laid out alike
    rng = np.random.default_rng(0)
    for r in refs[:: max(1, len(refs) // 7)]:
        buf = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
        fast, checked = loc.views(r, buf), loc._checked_views(r, buf)
        for part in ("w1", "w3", "w2"):
            assert _same(getattr(fast, part), getattr(checked, part)), part


def test_a_view_over_an_unusual_buffer_takes_the_checked_path(located) -> None:
    cfg, loc = located
    r = loc.ref(_moe_layers(cfg)[0], 3)
    spaced = np.random.default_rng(1).integers(0, 256, 2 * r.nbytes, dtype=np.uint8)[::2]
    got = loc.views(r, spaced)  # not contiguous: the checked path, which copies
    for part in ("w1", "w3", "w2"):
        a, b = getattr(got, part), getattr(loc._checked_views(r, spaced), part)
        assert isinstance(a, Mxfp4) and isinstance(b, Mxfp4)
        assert np.array_equal(a.packed, b.packed) and np.array_equal(a.scales, b.scales)
    short = np.zeros(r.nbytes - 1, dtype=np.uint8)
    with pytest.raises((ValueError, CheckpointError)):
        loc.views(r, short)


def _reshaped(ref: ExpertRef, key: str, shape: tuple[int, ...]) -> ExpertRef:
    parts = tuple(dataclasses.replace(p, shape=shape) if p.key == key else p for p in ref.parts)
    layout = tuple((p.key, p.slot_off, p.nbytes, p.shape, p.dtype) for p in parts)
    return dataclasses.replace(ref, parts=parts, layout=layout)


def test_a_layout_that_fails_its_check_is_refused_every_time(located) -> None:
    cfg, loc = located
    L = _moe_layers(cfg)[-1]
    good = loc.ref(L, 1)
    rows, half = next(p.shape for p in good.parts if p.key == "w2.weight_packed")
    bad = _reshaped(good, "w2.weight_packed", (rows // 2, half * 2))  # same bytes, wrong shape
    plans = dict(loc._plans)
    for _ in range(2):  # a refused layout is never remembered as checked
        with pytest.raises(CheckpointError, match="experts.1.w2.weight_packed"):
            loc._check(bad)
        with pytest.raises(CheckpointError, match="do not describe"):
            loc.views(bad, np.zeros(bad.nbytes, dtype=np.uint8))
    assert loc._plans == plans
