"""``--cache-trace`` is refused without ``--cache-policy replay`` and for another model."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    tiny = root / "tiny"
    synthesize(tiny, ModelConfig.from_json_dict(size_config("tiny")), seed=1)
    other = root / "other"  # same layers, more experts and a larger top-k
    synthesize(other, ModelConfig.from_json_dict(
        size_config("tiny", {"num_experts": 16, "num_experts_per_token": 3})), seed=2)
    trace = root / "trace"
    res = runner.invoke(app, ["run", str(tiny), "--ids", "3,7,11", "--gen", "2",
                              "--dump-cache-trace", str(trace)])
    assert res.exit_code == 0, res.output
    return tiny, other, trace


def k3(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cache_trace_without_replay_is_refused(models):
    tiny, _, trace = models
    for extra in ([], ["--cache-policy", "lru"]):
        res = k3("run", tiny, "--ids", "3,7,11", "--gen", "1", "--cache-trace",
                 trace / "expert_trace.bin", *extra)
        assert res.exit_code == 2, res.output
        assert "--cache-trace is read only by --cache-policy replay" in res.output


def test_the_same_models_trace_replays(models):
    tiny, _, trace = models
    res = k3("run", tiny, "--ids", "3,7,11", "--gen", "1", "--cache-policy", "replay",
             "--cache-trace", trace / "expert_trace.bin")
    assert res.exit_code == 0, res.output


def test_a_trace_of_another_model_is_refused(models, tmp_path):
    _, other, trace = models
    res = k3("run", other, "--ids", "3,7,11", "--gen", "1", "--cache-policy", "replay",
             "--cache-trace", trace / "expert_trace.bin")
    assert res.exit_code == 2, res.output
    assert "a trace of another model" in res.output
    alone = tmp_path / "expert_trace.bin"  # no expert_hist.json beside it: top-k tells
    alone.write_bytes((trace / "expert_trace.bin").read_bytes())
    res = k3("run", other, "--ids", "3,7,11", "--gen", "1", "--cache-policy", "replay",
             "--cache-trace", alone)
    assert res.exit_code == 2, res.output
    assert "not a multiple of this model's top-k 3" in res.output


def test_sim_cache_refuses_a_trace_of_another_model(models):
    tiny, other, trace = models
    res = k3("sim-cache", trace / "expert_trace.bin", "--model", other, "--slots", "20")
    assert res.exit_code == 2 and "a trace of another model" in res.output
    ok = k3("sim-cache", trace / "expert_trace.bin", "--model", tiny, "--slots", "20")
    assert ok.exit_code == 0, ok.output
