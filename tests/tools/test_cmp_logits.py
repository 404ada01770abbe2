"""``k3 cmp-logits``: the statistics, JSON output and refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.tools.logit_compare import compare_logits

runner = CliRunner()


def dump(path, values):
    np.asarray(values, dtype="<f4").tofile(path)
    return str(path)


def test_statistics_by_hand():
    a = np.array([1.0, 5.0, 2.0, -1.0], dtype=np.float32)
    b = np.array([1.0, 4.0, 2.5, -1.0], dtype=np.float32)
    r = compare_logits(a, b, top_k=2)
    assert r.max_abs_diff == 1.0 and r.mean_abs_diff == pytest.approx(0.375)
    assert r.max_rel_diff == pytest.approx(1.0 / 4.0)
    assert (r.argmax_a, r.argmax_b) == (1, 1) and r.top_k_overlap == 2
    assert r.correlation == pytest.approx(np.corrcoef(a, b)[0, 1])
    assert not r.identical
    same = compare_logits(a, a.copy())
    assert same.identical and same.max_abs_diff == 0 and same.correlation == pytest.approx(1.0)
    assert same.top_k == 4  # clamped to the vector length


def test_top_k_overlap_and_argmax_ties():
    a = np.array([3, 3, 1, 0, 2], dtype=np.float32)
    b = np.array([0, 3, 3, 1, 2], dtype=np.float32)
    r = compare_logits(a, b, top_k=2)
    assert (r.argmax_a, r.argmax_b) == (0, 1)  # ties go to the lowest index
    assert r.top_k_overlap == 1


def test_non_finite_values_are_counted():
    a = np.array([1, np.nan, 2, np.inf], dtype=np.float32)
    b = np.array([1, 0, 2, 3], dtype=np.float32)
    r = compare_logits(a, b)
    assert (r.nonfinite_a, r.nonfinite_b) == (2, 0) and r.max_abs_diff == 0
    assert r.argmax_a == 2


def test_cli_text_and_json(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    a, b = dump(tmp_path / "a.f32", x), dump(tmp_path / "b.f32", x + np.float32(1e-3))
    res = runner.invoke(app, ["cmp-logits", a, b, "--top-k", "5"])
    assert res.exit_code == 0, res.output
    assert "top-5 overlap : 5/5" in res.output and "same: yes" in res.output
    res = runner.invoke(app, ["cmp-logits", a, b, "--json"])
    doc = json.loads(res.output)
    assert doc["n"] == 1000 and doc["argmax_a"] == doc["argmax_b"] == int(np.argmax(x))
    assert doc["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)


@pytest.mark.parametrize("sizes", [(16, 20), (16, 15), (0, 0), (7, 7)])
def test_refuses_different_or_odd_sizes(tmp_path, sizes):
    pa, pb = tmp_path / "a", tmp_path / "b"
    pa.write_bytes(b"\0" * sizes[0])
    pb.write_bytes(b"\0" * sizes[1])
    res = runner.invoke(app, ["cmp-logits", str(pa), str(pb)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output


def test_missing_file_and_bad_top_k(tmp_path):
    a = dump(tmp_path / "a", [1, 2])
    assert runner.invoke(app, ["cmp-logits", a, str(tmp_path / "nope")]).exit_code == 2
    assert runner.invoke(app, ["cmp-logits", a, a, "--top-k", "0"]).exit_code == 2
    with pytest.raises(UsageError):
        compare_logits(np.zeros(3, np.float32), np.zeros(4, np.float32))


# ---- the verdict: exit 1 when the dumps disagree ------------------------------------------
def test_argmax_difference_exits_1(tmp_path):
    a = dump(tmp_path / "a", [0.0, 3.0, 1.0])
    b = dump(tmp_path / "b", [0.0, 1.0, 3.0])
    res = runner.invoke(app, ["cmp-logits", a, b])
    assert res.exit_code == 1
    assert "k3: error: the dumps disagree: argmax differs (A 1, B 2)" in res.output
    assert "same: NO" in res.output  # the statistics are still printed
    res = runner.invoke(app, ["cmp-logits", a, b, "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.output[: res.output.rindex("}") + 1])
    assert doc["agree"] is False and doc["problems"]


def test_tolerances(tmp_path):
    x = np.array([1.0, 5.0, 2.0, -1.0], dtype=np.float32)
    a = dump(tmp_path / "a", x)
    b = dump(tmp_path / "b", x + np.float32(0.01))
    assert runner.invoke(app, ["cmp-logits", a, b]).exit_code == 0  # no tolerance asked
    ok = runner.invoke(app, ["cmp-logits", a, b, "--atol", "0.02"])
    assert ok.exit_code == 0, ok.output
    assert "all values within" in ok.output
    assert runner.invoke(app, ["cmp-logits", a, b, "--rtol", "0.05"]).exit_code == 0
    bad = runner.invoke(app, ["cmp-logits", a, b, "--atol", "0.001"])
    assert bad.exit_code == 1 and "4 of 4 values fail" in bad.output
    assert runner.invoke(app, ["cmp-logits", a, a, "--atol", "0"]).exit_code == 0
    c = dump(tmp_path / "c", [1.0, 5.0, np.nan, -1.0])
    assert runner.invoke(app, ["cmp-logits", a, c, "--atol", "10"]).exit_code == 1
    assert runner.invoke(app, ["cmp-logits", c, c, "--atol", "0"]).exit_code == 0


@pytest.mark.parametrize("flag", ["--atol", "--rtol"])
def test_bad_tolerance_exits_2(tmp_path, flag):
    a = dump(tmp_path / "a", [1, 2])
    res = runner.invoke(app, ["cmp-logits", a, a, flag, "-1"])
    assert res.exit_code == 2 and f"{flag} must be" in res.output
