"""A MoE layer of many tokens schedules its expert reads on a side thread while the shared
experts run (``SIDE_SCHEDULE_TOKENS`` in k3core/model/local_experts.py): the same ids and logit
bytes as scheduling them inline, on every kernel backend that runs here, under a small
cache (misses, evictions, reuse) with and without router lookahead; the thread really takes
the work and is gone when the run ends; an error on it is the run's error, never a hang."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from thin import thinned
from typer.testing import CliRunner

from k3core.api.daemon_executor import DaemonExecutor
from k3core.cli.app import app
from k3core.model import local_experts
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import slot_bytes
from k3core.plugins.registry import get_registry
from k3core.testing.disk import disk_tmpdir
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
PROMPT = ",".join(str((7 * i + 3) % 97) for i in range(24))  # 24 ids: the side path at 16
BACKENDS = sorted(n for n in get_registry().names("kernel") if get_registry().probe("kernel", n).ok)
CACHE_GB = f"{(10 * slot_bytes(6528) + 1) / 1e9:.9f}"  # 10 slots of a 6,528-byte expert


@pytest.fixture(scope="module")
def work():
    with disk_tmpdir("k3-side-schedule-") as d:
        yield d


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 32, "num_experts_per_token": 4}))
    assert cfg.n_shared > 0  # the side thread runs beside the shared experts
    return synthesize(work / "tiny32", cfg, 5)


class CountingExecutor(DaemonExecutor):
    submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        CountingExecutor.submitted += 1
        return super().submit(fn, *args, **kwargs)


def run(model: Path, work: Path, tag: str, *extra: str) -> dict[str, Any]:
    out, logits = work / f"{tag}.json", work / f"{tag}.logits"
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", "4", "--cache-gb", CACHE_GB,
                              "--out", str(out), "--dump-logits", str(logits), *extra])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    rec["logits"] = logits.read_bytes()
    return rec


@pytest.mark.parametrize("lookahead", ["off", "out"])
@pytest.mark.parametrize("backend", thinned(BACKENDS, ("avx2", "numba")))
def test_side_scheduling_gives_the_inline_bits(model, work, monkeypatch, backend, lookahead):
    args = ("--backend", backend, "--lookahead", lookahead)
    monkeypatch.setattr(local_experts, "SIDE_SCHEDULE_TOKENS", 10**9)
    inline = run(model, work, f"inline-{backend}-{lookahead}", *args)
    monkeypatch.setattr(local_experts, "SIDE_SCHEDULE_TOKENS", 1)  # every pass, decode steps too
    monkeypatch.setattr(local_experts, "DaemonExecutor", CountingExecutor)
    before, threads = CountingExecutor.submitted, _side_threads()
    side = run(model, work, f"side-{backend}-{lookahead}", *args)
    assert CountingExecutor.submitted - before >= 4 * (ModelConfig.from_json_dict(
        json.loads((model / "config.json").read_text())).n_layers - 1)
    assert side["generated_ids"] == inline["generated_ids"]
    assert side["logits"] == inline["logits"]
    assert _side_threads() <= threads  # the run's side thread stopped with the run


def test_an_error_on_the_side_thread_is_the_runs_error(model, work, monkeypatch):
    from k3core.api.errors import CheckpointError
    from k3core.experts.cache import ExpertCache

    def broken(self, layer, requests):  # what the walk raises for a bad expert entry
        raise CheckpointError(f"routed expert {layer}/{requests[0]}: bad entry (injected)")

    monkeypatch.setattr(local_experts, "SIDE_SCHEDULE_TOKENS", 1)
    monkeypatch.setattr(ExpertCache, "prefetch", broken)
    threads = _side_threads()
    res = runner.invoke(app, ["run", str(model), "--ids", PROMPT, "--gen", "2", "--cache-gb", CACHE_GB])
    assert res.exit_code == 1, res.output
    assert "k3: error: routed expert 1/" in res.output and "(injected)" in res.output
    assert _side_threads() <= threads


def _side_threads() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate() if t.name == "k3-moe-schedule"}


def test_a_dropped_model_lets_its_side_thread_go(model):
    """An engine dropped without close: the idle side thread holds nothing of its jobs, so
    the model is collected and its finalizer stops the thread."""
    import gc
    import weakref

    import numpy as np

    from k3core.run.engine import open_engine
    from k3core.run.generate import generate
    from k3core.run.request import EngineRequest

    before = _side_threads()
    eng = open_engine(EngineRequest(model_dir=model, backend="numpy"))
    generate(eng.model, [int(i) for i in np.arange(20) % 50], 1, incremental=True)
    assert _side_threads() - before  # the 20-id pass used a side thread
    ref = weakref.ref(eng.model)
    eng.experts.close()
    del eng
    gc.collect()
    assert ref() is None
    for _ in range(100):  # the stop reaches the thread through its queue
        if not _side_threads() - before:
            break
        threading.Event().wait(0.05)
    assert not _side_threads() - before


def test_a_side_error_inside_an_outer_handler_is_raised_once(model, monkeypatch):
    """Called while the caller is handling another exception, the MoE still takes the side
    thread's error as its own, at once: the walk is not run a second time inline."""
    import numpy as np

    from k3core.api.errors import CheckpointError
    from k3core.experts.cache import ExpertCache
    from k3core.run.engine import open_engine
    from k3core.run.generate import generate
    from k3core.run.request import EngineRequest

    calls = {"n": 0}

    def broken(self, layer, requests):
        calls["n"] += 1
        raise CheckpointError(f"routed expert {layer}/{requests[0]}: bad entry (injected)")

    monkeypatch.setattr(local_experts, "SIDE_SCHEDULE_TOKENS", 1)
    monkeypatch.setattr(ExpertCache, "prefetch", broken)
    eng = open_engine(EngineRequest(model_dir=model, backend="numpy"))
    try:
        try:
            raise ValueError("the caller's own error, being handled")
        except ValueError:
            with pytest.raises(CheckpointError, match="injected"):
                generate(eng.model, [int(i) for i in np.arange(20) % 50], 1, incremental=True)
    finally:
        eng.close()
    assert calls["n"] == 1
