"""The router lookahead replayed offline (``k3core.experts.lookahead_sim``, ``k3 sim-cache``)
and its guess file (``expert_guess.bin``): numbers worked by hand on a synthetic trace, the
sidecar's refusals, old traces without guesses, and the engine's guesses replayed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.experts.guess_trace import (
    GUESS_NAME,
    GuessError,
    guess_bytes,
    parse_guesses,
    read_guesses,
)
from k3core.experts.lookahead_sim import recall
from k3core.experts.simulator import TraceView, replay, replay_policy
from k3core.experts.trace import write_trace
from k3core.plugins.registry import get_registry

runner = CliRunner()
# two passes of layers 1 and 2, top-2
PAIRS = np.array([[1, 0], [1, 1], [2, 2], [2, 3], [1, 0], [1, 1], [2, 4], [2, 5]], dtype=np.int32)
# before request 2: layer 2 will be [2, 3] (right); before request 6: [4, 9] (half right)
GUESSES = np.array([[2, 2, 2], [2, 2, 3], [6, 2, 4], [6, 2, 9]])


def lru(capacity: int):
    spec, _ = get_registry().resolve("cache", "lru")
    return spec.load()(capacity=capacity, n_layers=3, n_experts=16, topk=2)


def test_recall_counts_each_guessed_visit() -> None:
    r, visits = recall(TraceView.of(PAIRS), GUESSES)
    assert visits == 2 and r == pytest.approx(3 / 4)


def test_with_room_guesses_take_free_slots_and_the_wrong_one_is_wasted() -> None:
    c = replay(lru(6), TraceView.of(PAIRS), 6, 2, GUESSES)
    assert (c.requests, c.guess_reads, c.used, c.wasted, c.skipped) == (8, 4, 3, 1, 0)
    assert (c.hits, c.demand_reads) == (2, 3)  # layer 1 again in pass 2; 0, 1 and 5 read
    assert c.hits + c.used + c.demand_reads == c.requests


def test_a_guess_never_evicts_the_visit_in_use_or_a_due_layer() -> None:
    # 4 slots, full in pass 2 with layer 1 (just served) and layer 2 (due): nothing to take
    c = replay(lru(4), TraceView.of(PAIRS), 4, 2, GUESSES)
    assert (c.guess_reads, c.used, c.skipped, c.wasted) == (2, 2, 2, 0)
    assert (c.hits, c.demand_reads) == (2, 4)


def test_the_one_replay_loop_without_guesses_is_the_plain_replay() -> None:
    """The simulator and the lookahead replay share one loop: with no guesses (none given,
    or an empty sidecar) it counts what the plain replay counts."""
    view = TraceView.of(PAIRS)
    for cap in (4, 6):
        plain = replay(lru(cap), view, cap, 2)
        assert plain == replay(lru(cap), view, cap, 2, np.empty((0, 3), np.int64))
        assert plain.hits == replay_policy(lru(cap), view, cap, 2)
        assert plain.hits + plain.demand_reads == plain.requests
        assert (plain.guess_reads, plain.used, plain.wasted, plain.skipped) == (0, 0, 0, 0)


def test_guess_file_round_trip_and_refusals(tmp_path: Path) -> None:
    data = guess_bytes(GUESSES, len(PAIRS))
    assert np.array_equal(parse_guesses(data, len(PAIRS)), GUESSES)
    bad = {
        "bad magic": b"NOTGUESS" + data[8:],
        "version": data[:8] + (9).to_bytes(4, "little") + data[12:],
        "another trace": data[:16] + (99).to_bytes(8, "little") + data[24:],
        "whole records": data + b"\0",
        "shorter": data[:10],
        "backwards": guess_bytes(GUESSES[::-1], len(PAIRS)),
        "outside": guess_bytes(np.array([[9, 2, 2]]), len(PAIRS)),
    }
    for why, blob in bad.items():
        with pytest.raises(GuessError) as err:
            parse_guesses(blob, len(PAIRS), n_layers=3, n_experts=16)
        assert isinstance(err.value, UsageError) and err.value.exit_code == 2, why
    with pytest.raises(GuessError, match="expert"):
        parse_guesses(data, len(PAIRS), n_layers=3, n_experts=8)  # expert 9 of 8
    with pytest.raises(GuessError, match="no such file"):
        read_guesses(tmp_path / GUESS_NAME, len(PAIRS))


def test_write_trace_writes_the_sidecar_and_removes_a_stale_one(tmp_path: Path) -> None:
    write_trace(tmp_path, PAIRS, guesses=GUESSES)
    assert np.array_equal(read_guesses(tmp_path / GUESS_NAME, len(PAIRS)), GUESSES)
    write_trace(tmp_path, PAIRS[:4])
    assert not (tmp_path / GUESS_NAME).exists()


def test_sim_cache_replays_the_guesses_beside_the_trace(tmp_path: Path) -> None:
    write_trace(tmp_path, PAIRS, guesses=GUESSES)
    trace = str(tmp_path / "expert_trace.bin")
    res = runner.invoke(app, ["sim-cache", trace, "--topk", "2", "--slots", "6", "--json",
                              "--policy", "lru", "--expert-bytes", "1000"])
    assert res.exit_code == 0, res.output
    la = json.loads(res.stdout)["lookahead"]
    assert la["recall"] == pytest.approx(0.75) and la["guessed_visits"] == 2
    lru6 = la["rows"][0]["policies"]["lru"]
    assert (lru6["guess_reads"], lru6["used"], lru6["wasted"], lru6["wasted_bytes"]) == (4, 3, 1, 1000)
    assert lru6["demand_reads"] == 3 and lru6["demand_reads_without_lookahead"] == 6
    text = runner.invoke(app, ["sim-cache", trace, "--topk", "2", "--slots", "6"]).stdout
    assert "router lookahead: recall 75.0%" in text
    off = runner.invoke(app, ["sim-cache", trace, "--topk", "2", "--slots", "6", "--json",
                              "--no-lookahead"])
    assert "lookahead" not in json.loads(off.stdout)


def test_an_old_trace_without_guesses_still_loads(tmp_path: Path) -> None:
    write_trace(tmp_path, PAIRS)
    res = runner.invoke(app, ["sim-cache", str(tmp_path / "expert_trace.bin"), "--topk", "2",
                              "--slots", "6", "--json"])
    assert res.exit_code == 0 and "lookahead" not in json.loads(res.stdout)


def test_a_sidecar_of_another_trace_is_refused_in_one_line(tmp_path: Path) -> None:
    write_trace(tmp_path, PAIRS, guesses=GUESSES)
    other = tmp_path / "other"
    other.mkdir()
    write_trace(other, PAIRS[:6])
    res = runner.invoke(app, ["sim-cache", str(other / "expert_trace.bin"), "--topk", "2",
                              "--slots", "6", "--guesses", str(tmp_path / GUESS_NAME)])
    assert res.exit_code == 2
    assert "another trace" in res.output and "Traceback" not in res.output
