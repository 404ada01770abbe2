"""Router lookahead never changes the ids: ``k3 run --lookahead`` off, attn, out and on give
the same generated ids and step-0 logit bytes on every kernel backend that runs here, with
the trunk resident and streamed from a packed trunk (a ring of two slots), under a small
expert cache (guesses compete for slots), incrementally; under every cache policy at the
top-k + 1 floor, incremental and full recompute, with the metrics adding up; and the run
reports its figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from thin import thinned
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import slot_bytes
from k3core.plugins.registry import get_registry
from k3core.testing.disk import disk_tmpdir
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
PROMPT = "3,7,11,5,9"
BACKENDS = sorted(n for n in get_registry().names("kernel") if get_registry().probe("kernel", n).ok)
MODES = ("off", "attn", "out", "on")
CACHE_GB = f"{(10 * slot_bytes(6528) + 1) / 1e9:.9f}"  # 10 slots of a 6,528-byte expert


@pytest.fixture(scope="module")
def work():
    with disk_tmpdir("k3-lookahead-run-") as d:
        yield d


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 32, "num_experts_per_token": 4}))
    return synthesize(work / "tiny32", cfg, 11)


@pytest.fixture(scope="module")
def trunk(work: Path, model: Path) -> Path:
    out = work / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(model), str(out)])
    assert res.exit_code == 0, res.output
    return out


def run(model: Path, work: Path, tag: str, *extra: str) -> dict[str, Any]:
    out, logits = work / f"{tag}.json", work / f"{tag}.logits"
    if "--cache-gb" not in extra:
        extra = ("--cache-gb", CACHE_GB, *extra)
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", "5", "--out", str(out),
                              "--dump-logits", str(logits), *extra])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    rec["logits"] = logits.read_bytes()
    rec["stderr"] = res.output
    return rec


@pytest.mark.parametrize("backend", thinned(BACKENDS, ("avx2",)))
@pytest.mark.parametrize("where", ["resident", "streamed"])
def test_lookahead_never_changes_the_ids(model: Path, trunk: Path, work: Path, backend: str,
                                         where: str) -> None:
    extra = ["--backend", backend]
    if where == "streamed":
        extra += ["--trunk", str(trunk), "--trunk-gb", "0.0005", "--trunk-ring", "2"]
    recs = {m: run(model, work, f"{backend}-{where}-{m}", *extra, "--lookahead", m) for m in MODES}
    base = recs["off"]
    assert base["lookahead"] == "off" and base["lookahead_reads"] == 0
    for m, rec in recs.items():
        assert rec["generated_ids"] == base["generated_ids"], f"--lookahead {m} changed the ids"
        assert rec["logits"] == base["logits"], f"--lookahead {m} changed step 0's logits"
    for m in ("attn", "out"):
        rec = recs[m]
        assert rec["lookahead"] == m and rec["lookahead_guessed_layers"] > 0
        assert rec["lookahead_recall"] is not None and 0 <= rec["lookahead_recall"] <= 1
        assert rec["lookahead_reads"] > 0, f"--lookahead {m} read nothing"
        assert "router lookahead" in rec["stderr"] and "recall" in rec["stderr"]
    assert recs["on"]["lookahead"] in ("attn", "out")


def test_a_bad_lookahead_value_is_refused(model: Path) -> None:
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--lookahead", "maybe"])
    assert res.exit_code == 2
    assert "lookahead" in res.output and "Traceback" not in res.output


def test_expert_readers_is_taken_and_refused_out_of_range(model: Path, work: Path) -> None:
    rec = run(model, work, "readers1", "--expert-readers", "1", "--lookahead", "out")
    assert rec["generated_ids"] == run(model, work, "readers-base")["generated_ids"]
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--expert-readers", "0"])
    assert res.exit_code == 2 and "--expert-readers/--readers must be in 1..64" in res.output


POLICIES = sorted(get_registry().names("cache"))


@pytest.mark.parametrize("policy", thinned(POLICIES, ("cycle-eta", "replay")))
@pytest.mark.parametrize("mode", ["--incremental", "--full-recompute"])
def test_every_policy_at_the_floor_keeps_the_ids_and_the_metrics_add_up(
        model: Path, work: Path, policy: str, mode: str) -> None:
    floor = f"{(5 * slot_bytes(6528) + 1) / 1e9:.9f}"  # top-k + 1 slots: the hardest squeeze
    extra = ["--cache-policy", policy, "--cache-gb", floor, mode]
    if policy == "replay":
        trace = work / f"trace-{mode}"
        trace.mkdir(exist_ok=True)
        run(model, work, f"rec-{mode}", "--cache-gb", floor, mode, "--dump-cache-trace", str(trace))
        extra += ["--cache-trace", str(trace / "expert_trace.bin")]
    off = run(model, work, f"{policy}{mode}-off", *extra, "--lookahead", "off")
    on = run(model, work, f"{policy}{mode}-on", *extra, "--lookahead", "out")
    assert on["generated_ids"] == off["generated_ids"] and on["logits"] == off["logits"]
    assert on["expert_drops"] == 0 and on["lookahead_reads"] > 0
    for rec in (off, on):
        assert rec["expert_requests"] == (rec["expert_resident_hits"] + rec["expert_misses"]
                                          + rec["expert_reuse_in_step"])
        # every byte read is a miss's or a guess's
        assert rec["expert_bytes_read"] == rec["expert_misses"] * 6528 + rec["lookahead_bytes_read"]
    assert on["lookahead_used_reads"] <= on["lookahead_reads"]
    assert on["lookahead_wasted_bytes"] <= on["lookahead_bytes_read"]
