"""``k3 sim-cache`` through the real CLI: the shipped trace's targets, the forms, the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.fixtures import fixtures_dir
from k3core.tools.synth.writer import synthesize

runner = CliRunner()

SLOTS = (455, 911, 1823, 3647)
LRU = {455: 36.24, 911: 36.24, 1823: 36.24, 3647: 36.24}
BELADY = {455: 39.42, 911: 42.61, 1823: 48.99, 3647: 61.74}
GAP = {455: 0.0, 911: 0.5, 1823: 0.5, 3647: 0.75}


def k3(*args: object):
    return runner.invoke(app, ["sim-cache", *(str(a) for a in args)])


def _trace(path: Path, pairs: list[tuple[int, int]]) -> Path:
    np.asarray(pairs, dtype="<i4").tofile(path)
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A top-4 trace: 6 passes over 3 layers, 2 positions each, a few experts reused."""
    rng = np.random.default_rng(0)
    pairs = [(layer, int(e)) for _ in range(6) for layer in (1, 2, 3)
             for e in rng.choice(12, size=8, replace=True)]
    return _trace(tmp_path_factory.mktemp("sim") / "expert_trace.bin", pairs)


@pytest.mark.slow
def test_shipped_trace_meets_the_targets() -> None:
    res = k3(fixtures_dir() / "expert_trace.bin", "--slots", ",".join(map(str, SLOTS)), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["requests"], doc["distinct"]) == (100_096, 10_010)
    assert [r["slots"] for r in doc["rows"]] == list(SLOTS)
    offline = set(doc["offline"]) | {"belady"}
    for row in doc["rows"]:
        rate = row["hit_rate"]
        s = row["slots"]
        assert round(100 * rate["lru"], 2) == LRU[s]
        assert round(100 * rate["belady"], 2) == BELADY[s]
        best = max((p for p in rate if p not in offline), key=lambda p: rate[p])
        assert rate[best] > rate["lru"], s
        gap = (rate[best] - rate["lru"]) / (rate["belady"] - rate["lru"])
        assert gap >= GAP[s], (s, gap)


def test_table_plot_and_gb_sizes(small: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    res = k3(small, "--topk", 4, "--cache-gb", "0.0001,0.001", "--expert-bytes", 10_000, "--plot", png)
    assert res.exit_code == 0, res.output
    out = res.stdout
    for needle in ("SLOTS", "LRU", "BELADY", "CYCLE-ETA", "S3FIFO", "REPLAY", "READ/TOK",
                   "compulsory misses", "0.0001 GB", "wrote"):
        assert needle in out, needle
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hit.png"]


def test_policy_subset_and_skipped_sizes(small: Path) -> None:
    res = k3(small, "--topk", 4, "--slots", "3,5,40", "--policy", "lru", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["skipped_slots"] == [3]
    assert [r["slots"] for r in doc["rows"]] == [5, 40]
    assert set(doc["rows"][0]["hit_rate"]) == {"lru", "belady"}
    # with room for every key every policy reaches the compulsory ceiling
    assert doc["rows"][1]["hit_rate"]["lru"] == doc["compulsory_ceiling"]


def test_model_gives_the_shape(tmp_path: Path) -> None:
    cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 12, "num_experts_per_token": 4}))
    model = synthesize(tmp_path / "m", cfg, 0)
    pairs = [(layer, e) for _ in range(3) for layer in range(1, 13) for e in (0, 3, 5, 7)]
    trace = _trace(tmp_path / "t.bin", pairs)
    res = k3(trace, "--model", model, "--slots", "5,48", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["n_layers"], doc["n_experts"], doc["requests_per_token"]) == (12, 12, 48)
    assert doc["pool"] == 12 * 12  # MoE layers x experts (layer 0 is dense)
    assert doc["tokens"] == 3 and doc["expert_bytes"] > 0
    assert doc["rows"][1]["hit_rate"]["lru"] == pytest.approx(2 / 3, abs=1e-6)
    # a trace naming an expert the model does not have is refused
    bad = _trace(tmp_path / "bad.bin", [(1, 12)] * 4)
    res = k3(bad, "--model", model, "--slots", "5")
    assert res.exit_code == 2 and "expert 12" in res.output
    bad = _trace(tmp_path / "bad.bin", [(13, 1)] * 4)
    res = k3(bad, "--model", model, "--slots", "5")
    assert res.exit_code == 2 and "layer 13" in res.output


@pytest.mark.parametrize(
    "make, args, needle",
    [
        (None, ["--slots", "455"], "no such file"),
        (b"", ["--slots", "455"], "empty"),
        (b"\x01\x00\x00\x00\x02\x00", ["--slots", "455"], "whole number of int32"),
        (b"\x01\x00\x00\x00", ["--slots", "455"], "odd count"),
        (np.asarray([(-1, 3)] * 16, dtype="<i4").tobytes(), ["--slots", "455"], "layer -1"),
        ("small", ["--slots", "455,x"], "bad --slots value 'x'"),
        ("small", ["--slots", "0"], "must be positive"),
        ("small", ["--slots", ""], "no sizes"),
        ("small", ["--cache-gb", "nan"], "must be positive"),
        ("small", ["--cache-gb", "-1"], "must be positive"),
        ("small", ["--slots", "40", "--cache-gb", "1"], "not both"),
        ("small", ["--slots", "40", "--expert-bytes", "0"], "--expert-bytes must be a positive"),
        ("small", ["--slots", "40", "--topk", "0"], "--topk must be a positive"),
        ("small", ["--slots", "40"], "not a multiple of top-k 16"),
        ("small", ["--topk", "4", "--slots", "2,4"], "under top-k + 1 = 5 slots"),
        ("small", ["--topk", "4", "--cache-gb", "1", "--expert-bytes", "1000000000"], "under top-k + 1"),
        ("small", ["--topk", "4", "--slots", "40", "--policy", "nosuch"], "unknown cache policy"),
        ("small", ["--slots", "40", "--model", "no-such-dir"], "not a directory"),
        ("small", ["--topk", "4", "--slots", "40", "--serve", "rows"], "--serve must be one of"),
    ],
)
def test_refusals_exit_2_with_one_message(make, args, needle, small: Path, tmp_path: Path) -> None:
    if make is None:
        trace = tmp_path / "missing.bin"
    elif make == "small":
        trace = small
    else:
        trace = tmp_path / "t.bin"
        trace.write_bytes(make)
    res = k3(trace, *args)
    assert res.exit_code == 2, res.output
    assert needle in res.output, res.output
    assert res.output.count("k3: error:") == 1 and "Traceback" not in res.output


def test_plot_into_a_missing_directory_is_an_output_error(small: Path, tmp_path: Path) -> None:
    res = k3(small, "--topk", 4, "--slots", "40", "--plot", tmp_path / "nope" / "x.png")
    assert res.exit_code == 3 and "does not exist" in res.output


def test_serve_visits_on_a_gzipped_fixture() -> None:
    """The demo model's batched-decode fixture (gzipped) as the engine serves a visit: every
    repeat within a visit a hit, so each policy gains over the request-by-request replay."""
    demo = Path(__file__).resolve().parents[2] / "demo-model"
    trace = Path(__file__).resolve().parents[1] / "experts" / "data" / "demo_batch4_trace.bin.gz"
    got = {}
    for serve in ("requests", "visits"):
        res = k3(trace, "--model", demo, "--slots", "16", "--policy", "lru", "--serve", serve,
                 "--json")
        assert res.exit_code == 0, res.output
        got[serve] = json.loads(res.stdout)
    assert got["visits"]["serve"] == "visits" and got["requests"]["serve"] == "requests"
    by_visit, by_request = (got[s]["rows"][0]["hit_rate"] for s in ("visits", "requests"))
    assert by_visit["lru"] > by_request["lru"] and by_visit["belady"] > by_request["belady"]
    text = k3(trace, "--model", demo, "--slots", "16", "--policy", "lru", "--serve", "visits")
    assert text.exit_code == 0 and "each expert once" in text.stdout
