"""``k3 bench-ladder``: budgets, one real capped rung, the TSV, the same-ids gate."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.api.errors import K3Error, UsageError
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.tools.bench.ladder import (
    K3_CMD,
    MIN_RUNGS,
    Rung,
    check_same_ids,
    default_budgets,
    make_limit,
    parse_budgets,
    run_rung,
    tsv_text,
)
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path, ModelConfig]:
    work = disk_backed_dir(tmp_path_factory.mktemp("ladder"))
    cfg = ModelConfig.from_json_dict(size_config("tiny"))
    model = synthesize(work / "tiny", cfg, 7)
    assert runner.invoke(app, ["pack-trunk", str(model), str(work / "trunk")]).exit_code == 0
    return model, work / "trunk", cfg


def test_default_budgets_span_floor_to_all_pinned() -> None:
    sizes = [90_000_000] + [40_000_000] * 24
    b = default_budgets(sizes)
    assert len(b) >= MIN_RUNGS and b == sorted(b)
    assert b[0] * 1e9 >= max(sizes) and b[0] * 1e9 - max(sizes) < 1e3
    assert abs(b[1] * 1e9 - 2 * max(sizes)) < 1e3 and abs(b[-1] * 1e9 - sum(sizes)) < 1e3
    assert parse_budgets("0.5,0.1,0.5") == [0.1, 0.5]
    with pytest.raises(UsageError):
        parse_budgets("0.1,x")
    with pytest.raises(UsageError):
        parse_budgets("-1")


def test_same_ids_gate() -> None:
    a, b = Rung(0.1, ok=True, ids=[1, 2]), Rung(0.2, ok=True, ids=[1, 2])
    check_same_ids([a, b])
    with pytest.raises(K3Error, match="every budget must give the same tokens"):
        check_same_ids([a, Rung(0.3, ok=True, ids=[1, 3])])
    with pytest.raises(K3Error, match="rung\\(s\\) failed"):
        check_same_ids([a, Rung(0.3, error="exit 1: boom")])
    text = tsv_text([a, b])
    assert text.splitlines()[0].startswith("budget_gb\tpinned_layers") and text.count("\n") == 3


def test_limit_is_enforced_somehow() -> None:
    lim = make_limit(1_000_000_000, "t")
    try:
        assert lim.kind in ("cgroup-v2", "rlimit-as", "none")
        if lim.kind != "none":
            assert lim.nbytes > 1_000_000_000 and lim.preexec() is not None
    finally:
        lim.close()


def test_one_real_rung(packed, tmp_path) -> None:
    model, trunk, cfg = packed
    base = [*K3_CMD, "run", str(model), "--ids", "3,7,11", "--gen", "3", "--incremental",
            "--trunk", str(trunk)]
    r = run_rung(0, 0.0005, cfg, base, tmp_path, 7, 500_000_000, True, 120)
    assert r.ok, r.error
    assert r.ring == 2 and r.pinned == 0 and r.steps == 3 and len(r.ids) == 3
    assert r.trunk_bytes_per_token > 0 and r.peak_rss > 0 and r.plan_total > 0
    bad = run_rung(1, 0.00001, cfg, base, tmp_path, 7, 500_000_000, True, 120)
    assert not bad.ok and "exit 2" in bad.error and "below the floor" in bad.error


@pytest.mark.slow
def test_bench_ladder_end_to_end(packed, tmp_path) -> None:
    model, trunk, _ = packed
    out = tmp_path / "ladder"
    res = runner.invoke(app, ["bench-ladder", str(model), str(trunk), "--gen", "3",
                              "--out-dir", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "ladder.tsv").is_file() and (out / "ladder.png").stat().st_size > 1000
    rows = (out / "ladder.tsv").read_text().splitlines()
    assert len(rows) - 1 >= MIN_RUNGS
    assert "every rung generated" in res.output and "bound by" in res.output


def test_codec_rungs_are_gated_and_get_their_columns() -> None:
    coded = Rung(0.1, ok=True, ids=[1, 2], codec="bp-zstd", s_per_token=0.25,
                 trunk_bytes_per_token=2e9)
    a = Rung(0.1, ok=True, ids=[1, 2], coded=coded)
    check_same_ids([a])
    rows = [line.split("\t") for line in tsv_text([a, Rung(0.2, ok=True, ids=[1, 2])]).splitlines()]
    cells = dict(zip(rows[0], rows[1], strict=True))
    assert (cells["codec"], cells["codec_s_per_token"], cells["codec_trunk_gb_read_per_token"],
            cells["codec_ok"]) == ("bp-zstd", "0.250", "2.0000", "yes")
    assert dict(zip(rows[0], rows[2], strict=True))["codec"] == "-"
    a.coded = Rung(0.1, ok=True, ids=[1, 3], codec="bp-zstd")
    with pytest.raises(K3Error, match="a codec must give the same tokens"):
        check_same_ids([a])
    a.coded = Rung(0.1, error="exit 1: bad window", codec="bp-zstd")
    with pytest.raises(K3Error, match="bad window"):
        check_same_ids([a])
