"""``k3 bench serve``: the statistics on known inputs, one real run against a ``k3 serve`` of
the demo model (every field present, every reply exactly ``--max-tokens`` long, the server
gone afterwards), and the refusals (exit 2 for bad input, exit 1 for a server that does not
start)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.tools.bench.serve import (
    RequestTiming,
    Workload,
    batch_fields,
    percentile,
    phase_stats,
    prompt_ids,
    ratio,
)

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
runner = CliRunner()

PHASE_KEYS = {"clients", "requests", "tokens", "seconds", "tokens_per_s", "requests_per_s",
              "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "tokens_each"}
JSON_KEYS = {"model", "clients", "requests", "prompt_tokens", "max_tokens", "warmup", "seed",
             "server_args", "server", "lone", "concurrent", "tokens_per_s_ratio",
             "ttft_p95_ratio", "exact_tokens"}


# ---- the statistics -------------------------------------------------------------------------
def test_percentile_interpolates_between_ranks_as_numpy_does() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 100) == 5.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_phase_stats_of_known_timings() -> None:
    a = RequestTiming(sent=0.0, chunks=(0.5, 0.6, 0.8), done=0.9, tokens=3)
    b = RequestTiming(sent=1.0, chunks=(2.0, 2.1), done=2.2, tokens=2)
    s = phase_stats([b, a], seconds=2.5, clients=2)  # ordered by when each was sent
    assert (s.clients, s.requests, s.tokens, s.seconds) == (2, 2, 5, 2.5)
    assert s.tokens_per_s == pytest.approx(2.0) and s.requests_per_s == pytest.approx(0.8)
    assert s.ttft_p50 == pytest.approx(0.75)  # ttfts 0.5 and 1.0
    assert s.ttft_p95 == pytest.approx(0.975)
    assert s.itl_p50 == pytest.approx(0.1)  # gaps 0.1, 0.2, 0.1
    assert s.itl_p95 == pytest.approx(0.19)
    assert s.tokens_each == [3, 2]


def test_a_reply_without_text_counts_its_end_as_first_token() -> None:
    t = RequestTiming(sent=1.0, chunks=(), done=1.25, tokens=1)
    s = phase_stats([t], seconds=0.0, clients=1)
    assert s.ttft_p50 == 0.25 and s.itl_p50 is None
    assert s.tokens_per_s is None and s.requests_per_s is None  # no wall time: no rate


def test_ratio_and_batch_fields() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None
    health = {"status": "ok", "batch": {"running": 0}, "max_batch_size": 8,
              "scheduler": {"batch_rows": 2, "passes": 9}, "waiting": 0}
    assert batch_fields(health) == {"batch": {"running": 0}, "max_batch_size": 8,
                                    "scheduler.batch_rows": 2}
    assert batch_fields({"status": "ok"}) == {}


def test_prompts_are_deterministic_and_share_no_prefix() -> None:
    p = [prompt_ids(i, 6, 4096, seed=1) for i in range(50)]
    assert p == [prompt_ids(i, 6, 4096, seed=1) for i in range(50)]
    assert all(len(x) == 6 and all(0 <= v < 4096 for v in x) for x in p)
    assert len({x[0] for x in p}) == 50
    assert prompt_ids(0, 6, 4096, seed=2) != p[0]


def test_the_workload_refuses_its_own_bad_values() -> None:
    from k3core.api.errors import UsageError

    for bad in ({"clients": 0}, {"requests": 0}, {"prompt_tokens": 0}, {"max_tokens": 0},
                {"warmup": -1}):
        with pytest.raises(UsageError):
            Workload(**{"clients": 1, "requests": 1, "prompt_tokens": 1, "max_tokens": 1, **bad})
    assert Workload(clients=4, requests=2, prompt_tokens=1, max_tokens=1).lone == 2


# ---- the real thing -------------------------------------------------------------------------
def _children() -> set[int]:
    """This process's children now (a server the bench left behind would be one)."""
    me = os.getpid()
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(d.name))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_a_real_run_on_the_demo_model() -> None:
    before = _children()
    res = runner.invoke(app, ["bench", "serve", str(DEMO), "--clients", "2", "--requests", "4",
                              "--prompt-tokens", "8", "--max-tokens", "5", "--warmup", "0",
                              "--threads", "1", "--json", "-q"], env={"K3_THREADS": "1"})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert JSON_KEYS <= set(doc) <= JSON_KEYS | {"health_batch"}
    assert set(doc["lone"]) == PHASE_KEYS and set(doc["concurrent"]) == PHASE_KEYS
    assert doc["lone"]["tokens_each"] == [5, 5, 5] and doc["lone"]["clients"] == 1
    assert doc["concurrent"]["tokens_each"] == [5] * 4 and doc["concurrent"]["clients"] == 2
    assert doc["concurrent"]["tokens"] == 20 and doc["exact_tokens"] is True
    for phase in ("lone", "concurrent"):
        p = doc[phase]
        assert p["tokens_per_s"] > 0 and p["requests_per_s"] > 0
        assert 0 < p["ttft_p50"] <= p["ttft_p95"] and 0 < p["itl_p50"] <= p["itl_p95"]
    assert doc["tokens_per_s_ratio"] > 0 and doc["ttft_p95_ratio"] > 0
    assert "--threads=1" in doc["server_args"]
    assert _children() <= before  # the server was stopped


def test_the_human_table() -> None:
    res = runner.invoke(app, ["bench", "serve", str(DEMO), "--clients", "2", "--requests", "2",
                              "--prompt-tokens", "4", "--max-tokens", "3", "--warmup", "0",
                              "-q"], env={"K3_THREADS": "1"})
    assert res.exit_code == 0, res.output
    out = res.output
    assert "TTFT p95 ms" in out and "ITL p50 ms" in out
    assert any(line.startswith("lone ") for line in out.splitlines())
    assert any(line.startswith("concurrent ") for line in out.splitlines())
    assert "concurrent / lone:" in out


# ---- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--clients", "0"], "--clients must be >= 1"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--max-tokens", "5000"], "--max-tokens must be at most"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_bad_input_is_refused_with_one_line_and_exit_2(args: list[str], words: str) -> None:
    res = runner.invoke(app, ["bench", "serve", str(DEMO), *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3: error: ") and words in lines[0]


def test_a_missing_model_directory_is_refused(tmp_path: Path) -> None:
    res = runner.invoke(app, ["bench", "serve", str(tmp_path / "nope")])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"k3: error: bench serve: MODEL_DIR {tmp_path / 'nope'} "
                                               "is not a directory"]


def test_a_server_that_does_not_start_is_exit_1_with_its_reason() -> None:
    res = runner.invoke(app, ["bench", "serve", str(DEMO), "--requests", "1", "-q",
                              "--serve-arg=--chat-format=bogus"])
    assert res.exit_code == 1, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("k3: error: bench serve: the server did not start: the server exited "
                           "with code 2: unknown chat format 'bogus'")
    assert "  server: k3: error: unknown chat format 'bogus'" in res.output  # its own lines shown
