"""Chunked prefill through ``k3 run`` and the memory plan: a prompt fed in chunks of
``--prefill-chunk N`` ids gives the one-pass logits and ids byte for byte, the run report and
``--out`` say how many passes it took and what the routed experts read, and the plan's chunk
comes from its activations budget (docs/engine-behaviours.md, memory plan)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.memory_plan import (
    ACTIVATIONS_CAP,
    MemoryRequest,
    buffer_bytes,
    plan_memory,
    prefill_chunk,
)
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
IDS = "3,7,11,5,9,2,14,8,1"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("chunk") / "tiny"
    synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), seed=3)
    return out


def _run(model, tmp_path, name, *extra):
    out, dump = tmp_path / f"{name}.json", tmp_path / f"{name}.f32"
    res = runner.invoke(app, ["run", str(model), "--ids", IDS, "--gen", "3", "--ignore-eos",
                              "--backend", "numpy", "--out", str(out), "--dump-logits", str(dump),
                              *map(str, extra)])
    assert res.exit_code == 0, res.output
    return res.output, json.loads(out.read_text()), dump.read_bytes()


@pytest.mark.parametrize("mode", ["--incremental", "--full-recompute"])
def test_chunked_run_is_the_one_pass_run(model, tmp_path, mode):
    _, whole, whole_logits = _run(model, tmp_path, "whole", mode)
    text, chunked, chunked_logits = _run(model, tmp_path, "chunked", mode, "--prefill-chunk", 4)
    assert chunked_logits == whole_logits
    assert chunked["generated_ids"] == whole["generated_ids"]
    assert whole["prefill_chunks"] == 1 and whole["prefill_ids"] == 9
    assert chunked["prefill_chunks"] == 3 and chunked["prefill_chunk"] == 4
    assert chunked["prefill_expert_bytes_if_per_token"] == whole["prefill_expert_bytes_if_per_token"] > 0
    assert "prefill: 9 ids in 3 pass(es) of at most 4 ids" in text


def _tiny() -> ModelConfig:
    return ModelConfig.from_json_dict(size_config("tiny"))


def test_plan_chunk_from_the_activations_budget() -> None:
    cfg = _tiny()
    avail = 10**9  # 10 % of it: 100 MB of activations
    n = prefill_chunk(cfg, avail)
    assert buffer_bytes(cfg, n) <= avail // 10 < buffer_bytes(cfg, n + 1)
    assert prefill_chunk(cfg, 10**15) == prefill_chunk(cfg, 10 * ACTIVATIONS_CAP)  # the cap
    assert prefill_chunk(cfg, 0) == 1  # never zero

    def plan(prompt: int, chunk: int | None = None):
        return plan_memory(cfg, MemoryRequest(streamed=False, cache_bytes=0, prompt_len=prompt,
                                              gen=1, incremental=True, prefill_chunk=chunk),
                           baseline=0, available=avail)

    short, long = plan(10), plan(10 * n)
    assert short.prefill_chunk == long.prefill_chunk == n
    assert short.buffers == buffer_bytes(cfg, 12)
    assert long.buffers == buffer_bytes(cfg, n), "a long prompt plans one chunk's buffers"
    assert any("chunks of" in note for note in long.notes)
    assert plan(100, chunk=8).buffers == buffer_bytes(cfg, 8)
    with pytest.raises(UsageError, match="prefill_chunk must be >= 1"):
        plan(100, chunk=0)
