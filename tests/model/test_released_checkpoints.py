"""The tiny checkpoints in the released layout (sharded + nested config, and flat): logits of
``k3 run --ids 3,7,11,5,9 --dump-logits`` match the PyTorch reference within 1e-4 of the
largest logit, argmax 92."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.cli.app import app


@pytest.mark.parametrize("name", ["tiny-released", "tiny-flat"])
def test_reference_logits(fixtures, tmp_path, name):
    ref = json.loads((fixtures / name / "ref_logits.json").read_text())
    dump = tmp_path / "logits.f32"
    res = CliRunner().invoke(
        app,
        ["run", str(fixtures / name), "--ids", "3,7,11,5,9", "--gen", "1", "--dump-logits", str(dump), "--backend", "numpy"],
    )
    assert res.exit_code == 0, res.output
    got = np.fromfile(dump, dtype="<f4")
    want = np.asarray(ref["logits_bits"], dtype=np.uint32).view(np.float32)
    assert got.shape == want.shape == (ref["vocab"],)
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
    assert int(got.argmax()) == ref["argmax"] == 92


def test_nested_and_flat_twins_agree_bitwise(fixtures, tmp_path):
    out = {}
    for name in ("tiny-released", "tiny-flat"):
        dump = tmp_path / f"{name}.f32"
        res = CliRunner().invoke(
            app, ["run", str(fixtures / name), "--ids", "3,7,11,5,9", "--gen", "1", "--dump-logits", str(dump)]
        )
        assert res.exit_code == 0, res.output
        out[name] = dump.read_bytes()
    assert out["tiny-released"] == out["tiny-flat"]


@pytest.mark.parametrize("cfg", ["no_layermap", "bad_layer_index", "bad_topk"])
def test_bad_configs_refused_with_exit_2(fixtures, cfg):
    res = CliRunner().invoke(
        app,
        ["run", str(fixtures / "tiny-flat"), "--ids", "3", "--config", str(fixtures / "cfg" / f"{cfg}.json")],
    )
    assert res.exit_code == 2
    expect = {"no_layermap": "full_attn_layers", "bad_layer_index": "999", "bad_topk": "128"}[cfg]
    assert expect in res.output
