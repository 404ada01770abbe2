"""``k3 budget``: classification by tensor name, per-layer sizes and each preset's plan."""

from __future__ import annotations

import json

import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.api.units import human
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import sizes_from_config
from k3core.run.presets import SHIPPED, list_presets
from k3core.tools.budget import add_plans, budget_report
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
GB = 1_000_000_000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget") / "tiny"
    return synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), 2)


@pytest.fixture(autouse=True)
def no_user_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CONFIG_DIR", str(tmp_path / "cfg"))


def test_classification_adds_up(model):
    b = budget_report(model, PlainStorage())
    cfg = b.cfg
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        total = idx.total_bytes
    assert b.total_bytes == total
    assert b.sizes.trunk_bytes + b.sizes.tables_bytes + b.expert_total_bytes == total
    assert b.expert_count == cfg.n_experts * (cfg.n_layers - cfg.first_dense)
    assert b.expert_size_range[0] == b.expert_size_range[1] == b.sizes.expert_bytes
    # the config's plan (released dtypes) is within the small vectors synth keeps as f32
    planned = sizes_from_config(cfg)
    for real, plan in zip(b.sizes.layer_bytes, planned.layer_bytes, strict=True):
        assert 0 <= real - plan <= 8 * cfg.hidden * 2
    assert b.sizes.expert_bytes == planned.expert_bytes
    assert b.shared_expert_bytes > 0 and b.other_count == 0
    assert b.sizes.expert_bytes_per_token == cfg.topk * 12 * b.sizes.expert_bytes
    lb = b.sizes.layer_bytes
    assert b.largest_layer == lb.index(max(lb))


def test_plans_for_every_preset(model):
    b = budget_report(model, PlainStorage())
    add_plans(b, list_presets(), prompt_len=5, gen=8, incremental=True, available=8 * GB,
              total=16 * GB, baseline=40_000_000)
    assert [n for n, _, _ in b.plans] == [*SHIPPED, "auto"]
    for _, plan, _ in b.plans:
        assert plan is not None and plan.fits()  # a tiny model fits every preset
    tiny = budget_report(model, PlainStorage())
    add_plans(tiny, list_presets(), prompt_len=5, gen=8, incremental=True, available=1_000,
              total=2_000, baseline=40_000_000)
    assert not any(p.fits() for _, p, _ in tiny.plans if p is not None)
    assert tiny.plans[-1][1] is None and "below the floor" in tiny.plans[-1][2]


def test_cli_text_and_json(model):
    res = runner.invoke(app, ["budget", str(model)])
    assert res.exit_code == 0, res.output
    assert "routed experts   :" in res.output and "STREAMED" in res.output
    assert "memory each preset would plan:" in res.output
    assert "largest: layer" in res.output
    res = runner.invoke(app, ["budget", str(model), "--json"])
    doc = json.loads(res.output)
    assert doc["expert_count"] == 96 and len(doc["trunk_layer_bytes"]) == 13
    assert [p["preset"] for p in doc["plans"]] == [*SHIPPED, "auto"]


def test_released_fixture(fixtures):
    b = budget_report(fixtures / "tiny-released", PlainStorage())
    assert b.shards == 4 and b.expert_count > 0
    assert b.sizes.trunk_bytes + b.sizes.tables_bytes + b.expert_total_bytes == b.total_bytes


def test_env_model_dir_and_refusals(model, monkeypatch, tmp_path):
    monkeypatch.setenv("K3_MODEL_DIR", str(model))
    assert runner.invoke(app, ["budget"]).exit_code == 0
    monkeypatch.delenv("K3_MODEL_DIR")
    assert runner.invoke(app, ["budget"]).exit_code == 2
    assert runner.invoke(app, ["budget", str(tmp_path / "nope")]).exit_code == 2
    assert runner.invoke(app, ["budget", str(model), "--gen", "-1"]).exit_code == 2


@pytest.mark.parametrize("mode", ["--incremental", "--full-recompute"])
def test_budget_reports_the_latent_kv_cache_in_every_mode(model, mode):
    from k3core.model.config import load_config
    from k3core.model.state import kv_bytes_per_position

    per = kv_bytes_per_position(load_config(model))
    res = runner.invoke(app, ["budget", str(model), mode, "--prompt-len", "20", "--gen", "9"])
    assert res.exit_code == 0, res.output
    assert f"KV cache (latent): {human(30 * per)} for 30 positions" in res.output
    res = runner.invoke(app, ["budget", str(model), mode, "--prompt-len", "20", "--gen", "9",
                              "--json"])
    doc = json.loads(res.output)
    assert doc["kv_bytes_per_position"] == per > 0
    assert {p["kv_cache_bytes"] for p in doc["plans"]} == {30 * per}
