"""The cache never changes a result: ``k3 run`` on a synthetic model with more experts than
slots gives the same generated ids and the same step-0 logit bytes under every registered
policy, at every ``--cache-gb`` from the top-k + 1 floor to everything, under each storage
backend, incrementally, and with the experts' tensors scattered across the shards. Replaying
the first run's trace (``replay``) misses no more than any online policy."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import slot_bytes
from k3core.plugins.registry import get_registry
from k3core.testing.disk import disk_tmpdir
from k3core.testing.expert_cache_conformance import scatter_experts
from k3core.testing.faulty_backend import available_storage
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
PROMPT = "3,7,11,5,9"
GEN = 4
TOPK = 4
SLOT = slot_bytes(6528)  # one expert of this model is 6,528 bytes
SIZES = {"floor": TOPK + 1, "mid": 40, "all": None}  # slots; None: no --cache-gb
POLICIES = sorted(get_registry().names("cache"))


def gb_for(slots: int) -> str:
    return f"{(slots * SLOT + 1) / 1e9:.9f}"


@pytest.fixture(scope="module")
def work():
    with disk_tmpdir("k3-identity-") as d:
        yield d


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 32, "num_experts_per_token": TOPK}))
    return synthesize(work / "tiny32", cfg, 5)


def run(model: Path, work: Path, tag: str, *extra: str) -> dict[str, Any]:
    out, logits = work / f"{tag}.json", work / f"{tag}.logits"
    mode = [] if "--incremental" in extra else ["--full-recompute"]  # incremental is the default
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", str(GEN), "--out", str(out),
                              "--dump-logits", str(logits), *mode, *extra])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    rec["logits"] = logits.read_bytes()
    rec["stdout"] = res.output
    return rec


@pytest.fixture(scope="module")
def baseline(model: Path, work: Path) -> dict[str, Any]:
    (work / "trace").mkdir()
    rec = run(model, work, "baseline", "--cache-policy", "lru", "--dump-cache-trace", str(work / "trace"))
    assert len(rec["generated_ids"]) == GEN and len(rec["logits"]) == 4 * 1024
    assert (work / "trace" / "expert_trace.bin").stat().st_size == 8 * rec["expert_requests"]
    return rec


@pytest.fixture(scope="module")
def runs(model: Path, work: Path, baseline: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    trace = str(work / "trace" / "expert_trace.bin")
    for policy in POLICIES:
        for size, slots in SIZES.items():
            extra = ["--cache-policy", policy]
            if slots is not None:
                extra += ["--cache-gb", gb_for(slots)]
            if policy == "replay":
                extra += ["--cache-trace", trace]
            out[(policy, size)] = run(model, work, f"{policy}-{size}", *extra)
    return out


def same_result(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["generated_ids"] == b["generated_ids"]
    assert a["logits"] == b["logits"], "step-0 logits differ in their bytes"


@pytest.mark.slow
def test_every_policy_and_size_gives_identical_output(runs, baseline) -> None:
    assert {p for p, _ in runs} == set(POLICIES) and len(POLICIES) >= 4
    for (policy, size), rec in runs.items():
        same_result(rec, baseline)
        assert rec["expert_drops"] == 0 and rec["cache_policy"] == policy, (policy, size)
        assert f"{SIZES[size] or 12 * 32} slots" in rec["stdout"], (policy, size)
    # the floor really is under pressure, and everything fits at "all"
    assert all(runs[(p, "floor")]["expert_misses"] > runs[(p, "all")]["expert_misses"] for p in POLICIES)
    assert all(runs[(p, "all")]["expert_evictions"] == 0 for p in POLICIES)


def test_metrics_add_up(runs) -> None:
    for rec in runs.values():
        assert rec["expert_requests"] == baseline_requests(runs)
        assert rec["expert_requests"] == (rec["expert_resident_hits"] + rec["expert_misses"]
                                          + rec["expert_reuse_in_step"])
        assert rec["expert_bytes_read"] == rec["expert_misses"] * 6528


def baseline_requests(runs) -> int:
    return next(iter(runs.values()))["expert_requests"]


def test_replay_misses_no_more_than_any_online_policy(runs) -> None:
    online = [p for p in POLICIES if p != "replay"]
    for size in SIZES:
        rep = runs[("replay", size)]
        for p in online:
            other = runs[(p, size)]
            assert rep["expert_misses"] <= other["expert_misses"], (size, p)
            assert (rep["expert_resident_hits"] + rep["expert_reuse_in_step"]
                    >= other["expert_resident_hits"] + other["expert_reuse_in_step"]), (size, p)
        # it followed the recorded run request by request: Belady's decisions throughout
        m = re.search(r"replay: Belady from trace; (\d+) in step, (\d+) resyncs, (\d+) unmatched",
                      " ".join(rep["stdout"].split()))
        assert m is not None, rep["stdout"]
        assert int(m.group(3)) == 0, m.group(0)


@pytest.mark.parametrize("storage", available_storage())
def test_every_storage_backend_at_the_floor(model, work, baseline, storage) -> None:
    rec = run(model, work, f"storage-{storage}", "--storage", storage, "--cache-gb", gb_for(TOPK + 1))
    same_result(rec, baseline)
    assert rec["storage"] == storage


def test_incremental_at_the_floor(model, work, baseline) -> None:
    rec = run(model, work, "incremental", "--incremental", "--cache-gb", gb_for(TOPK + 1))
    same_result(rec, baseline)
    assert rec["incremental"] is True


def test_scattered_experts_read_per_tensor_give_the_same_result(model, work, baseline) -> None:
    scattered = scatter_experts(model, work / "tiny32-scattered")
    for storage in available_storage():
        rec = run(scattered, work, f"scattered-{storage}", "--storage", storage,
                  "--cache-gb", gb_for(TOPK + 1))
        same_result(rec, baseline)
