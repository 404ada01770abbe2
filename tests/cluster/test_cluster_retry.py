"""Faults survived: a worker whose process is killed between tokens or inside a layer is
restarted by Ray, opened again and sent the same call, and the tokens and logit bytes
equal an undisturbed run's; when the retries run out the run ends with exit 4 naming the
worker, its node and the layer, and ``--out`` keeps the tokens made so far."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from k3core.api.errors import ExpertDropError
from k3core.run.engine import open_engine
from k3core.run.generate import generate
from k3core.run.report import RunReport
from k3core.run.request import EngineRequest, RunRequest
from k3core.run.runner import execute

PROMPT = [3, 7, 11]
GEN = 4
#: the MoE layer of the first decode pass (forward pass 2) a worker is killed inside
LAYER = 5


@pytest.fixture
def restarting_pool(ray_session):
    """Two workers Ray restarts when they die (these tests kill them)."""
    from k3core.cluster.pool import start_pool

    p = start_pool(2, None, restarts=-1)
    yield p
    p.close()


def _request(tiny, remote: bool) -> EngineRequest:
    return EngineRequest(model_dir=tiny, backend="numpy", storage="mmap", remote_experts=remote)


def _undisturbed(tiny):
    eng = open_engine(_request(tiny, False))
    try:
        return generate(eng.model, PROMPT, GEN, incremental=True, keep_logits=True)
    finally:
        eng.close()


def _gone(pid: int, timeout_s: float = 30.0) -> None:
    """Wait until process ``pid`` no longer runs (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still runs")


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _gone(pid)


def _killer(hold: Path) -> threading.Thread:
    """Kills the worker that holds inside the armed layer (``worker.hold_point``)."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for f in hold.glob("inside-*"):
                _kill(int(f.read_text()))
                return
            time.sleep(0.01)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _same(res, ref) -> None:
    assert res.generated_ids == ref.generated_ids
    assert len(res.step_logits) == len(ref.step_logits) == GEN
    for a, b in zip(res.step_logits, ref.step_logits, strict=True):
        assert a.tobytes() == b.tobytes()


def _cluster_run(tiny, pool, on_step=None, **kw):
    from k3core.cluster.executor import ClusterExperts

    eng = open_engine(_request(tiny, True))
    ex = ClusterExperts(2, pool=pool, open_timeout_s=60, layer_timeout_s=60, **kw)
    try:
        ex.start(eng, lambda s: None)
        res = generate(eng.model, PROMPT, GEN, incremental=True, keep_logits=True,
                       on_step=on_step)
        record = ex.report(lambda s: None)
    finally:
        ex.close()
        eng.close()
    return res, record


def test_killed_between_tokens(tiny, restarting_pool):
    ref = _undisturbed(tiny)
    pool = restarting_pool
    killed: list[int] = []

    def on_step(st):
        if st.index in (0, 1):  # worker 1 after the first token, worker 0 after the second
            w = 1 - st.index
            pid = pool.info[w]["pid"]
            _kill(pid)
            killed.append(pid)

    t0 = time.monotonic()
    res, record = _cluster_run(tiny, pool, on_step)
    assert time.monotonic() - t0 < 120
    _same(res, ref)
    assert len(killed) == 2
    assert record["retried"] == 2 and {e["worker"] for e in record["retries_made"]} == {0, 1}
    assert all(info["pid"] not in killed for info in pool.info)  # new processes serve now


def test_killed_inside_a_layer(tiny, restarting_pool, tmp_path):
    ref = _undisturbed(tiny)
    (tmp_path / f"arm-2-{LAYER}").touch()
    killer = _killer(tmp_path)
    res, record = _cluster_run(tiny, restarting_pool, hold_dir=str(tmp_path))
    killer.join(5)
    assert list(tmp_path.glob("inside-*")), "no worker held inside the armed layer"
    _same(res, ref)
    assert record["retried"] == 1 and record["retries_made"][0]["layer"] == LAYER


def test_retries_run_out(tiny, restarting_pool, tmp_path):
    from k3core.cluster.executor import ClusterExperts

    ref = _undisturbed(tiny)
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / f"arm-2-{LAYER}").touch()
    out = tmp_path / "out.json"
    request = RunRequest.from_flags({"model_dir": tiny, "ids": ",".join(map(str, PROMPT)),
                                     "gen": GEN, "backend": "numpy", "storage": "mmap",
                                     "out": out, "quiet": True})
    ex = ClusterExperts(2, pool=restarting_pool, retries=0, hold_dir=str(hold),
                        open_timeout_s=60, layer_timeout_s=60)
    killer = _killer(hold)
    with pytest.raises(ExpertDropError) as err:
        execute(request, RunReport(-1), remote=ex)
    killer.join(5)
    e = err.value
    assert e.exit_code == 4
    m = re.search(r"expert worker (\d) \(([^,]+), node ([0-9a-f]{8}), pid (\d+)\) died during "
                  rf"MoE layer {LAYER};", e.message)
    assert m is not None, e.message
    record = json.loads(out.read_text())
    assert record["generated_ids"] == ref.generated_ids[:1]  # the prompt's token, made before
    assert record["stop_reason"] == "worker_lost"
    assert record["error"]["exit_code"] == 4 and record["error"]["message"] == e.message
