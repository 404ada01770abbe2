"""Faults: a worker that dies or stops answering mid-run ends the run with exit 4 naming the
worker and the layer (no hang, no token from a partial layer); a worker whose checkpoint
share differs from the head's is refused before the first token."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest

from k3core.api.errors import CheckpointError, ExpertDropError, K3Error
from k3core.experts.locator import ExpertLocator
from k3core.run.engine import open_engine
from k3core.run.generate import generate
from k3core.run.request import EngineRequest

PROMPT = [3, 7, 11]


@pytest.fixture
def fresh_pool(ray_session):
    """Two workers of their own: these tests kill or stop them."""
    from k3core.cluster.pool import start_pool

    p = start_pool(2, None)
    yield p
    for info in p.info:  # a stopped process must be able to die
        try:
            os.kill(info["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    p.close()


def _engine(tiny):
    return open_engine(EngineRequest(model_dir=tiny, backend="numpy", storage="mmap"))


def _reference(tiny) -> list[int]:
    eng = _engine(tiny)
    try:
        return generate(eng.model, PROMPT, 3).generated_ids
    finally:
        eng.close()


def _fault_run(tiny, pool, fault, timeout_s: float = 60.0):
    """Run 3 steps; ``fault(pool)`` fires after layer 4 of step 1. Returns the tokens made
    before the failure and the error."""
    from k3core.cluster.executor import ClusterExperts

    eng = _engine(tiny)
    ex = ClusterExperts(2, pool=pool, layer_timeout_s=timeout_s)
    made: list[int] = []
    state = {"step": 0}

    def on_layer(L, h):
        if state["step"] == 1 and L == 4:
            fault(pool)

    def on_step(st):
        made.append(st.token)
        state["step"] += 1

    try:
        ex.start(eng, lambda s: None)
        eng.model.on_layer = on_layer
        with pytest.raises(K3Error) as err:
            generate(eng.model, PROMPT, 3, on_step=on_step)
    finally:
        ex.close()
        eng.close()
    return made, err.value


def _failed_layer(err: K3Error) -> int:
    m = re.search(r"MoE layer (\d+)", err.message)
    assert m is not None, err.message
    return int(m.group(1))


def _kill(p) -> None:
    """Kill worker 1 and wait until Ray knows it is gone (the kill itself is asynchronous)."""
    p.ray.kill(p.actors[1], no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            p.ray.get(p.actors[1].describe.remote(), timeout=5)
        except p.ray.exceptions.RayActorError:
            return
        except p.ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError("the killed worker still answers")


def test_dead_worker_stops_the_run_with_exit_4(tiny, fresh_pool):
    ref = _reference(tiny)
    t0 = time.monotonic()
    made, err = _fault_run(tiny, fresh_pool, _kill)
    assert time.monotonic() - t0 < 90
    assert isinstance(err, ExpertDropError) and err.exit_code == 4
    assert "expert worker 1" in err.message and "died" in err.message
    # the first MoE layer after the kill that routes a row to worker 1
    assert 5 <= _failed_layer(err) <= 12
    assert made == ref[:1]  # the token before the death is right; none after it


def test_stopped_worker_times_out_with_exit_4(tiny, fresh_pool):
    ref = _reference(tiny)

    def stop(p):
        os.kill(p.info[0]["pid"], signal.SIGSTOP)

    t0 = time.monotonic()
    made, err = _fault_run(tiny, fresh_pool, stop, timeout_s=3.0)
    assert time.monotonic() - t0 < 40  # bounded: the 3 s layer timeout, not a hang
    assert isinstance(err, ExpertDropError) and err.exit_code == 4
    assert "expert worker 0" in err.message and "did not answer within 3 s" in err.message
    assert 5 <= _failed_layer(err) <= 12
    assert made == ref[:1]


def _copy(tiny, dst):
    shutil.copytree(tiny, dst)
    return dst


def _refused(tiny, pool, other) -> K3Error:
    from k3core.cluster.executor import ClusterExperts

    eng = _engine(tiny)
    ex = ClusterExperts(2, pool=pool, model_dirs=[str(tiny), str(other)])
    steps: list[int] = []
    try:
        with pytest.raises(K3Error) as err:
            ex.start(eng, lambda s: None)
            generate(eng.model, PROMPT, 1, on_step=lambda st: steps.append(st.token))
    finally:
        ex.close()
        eng.close()
    assert steps == []  # refused before the first token
    return err.value


def test_share_with_different_expert_bytes_is_refused(tiny, pool, tmp_path):
    from k3core.cluster.plan import plan_shares

    other = _copy(tiny, tmp_path / "copy")
    eng = _engine(tiny)
    try:
        loc = ExpertLocator(eng.cfg, eng.index)
        plan = plan_shares(eng.cfg, loc, eng.cfg.n_layers, 2)
        layer = min(plan.owner)
        expert = plan.owned(1)[layer][0]
        ref = loc.ref(layer, expert)
    finally:
        eng.close()
    path = other / ref.path.name
    data = bytearray(path.read_bytes())
    data[ref.offset + ref.nbytes // 2] ^= 0x01  # one bit of one owned expert, same size
    path.write_bytes(bytes(data))
    err = _refused(tiny, pool, other)
    assert isinstance(err, CheckpointError) and err.exit_code == 1
    assert "expert worker 1" in err.message and "differ" in err.message


def test_share_with_a_different_shard_size_is_refused(tiny, pool, tmp_path):
    other = _copy(tiny, tmp_path / "copy")
    shard = sorted(other.glob("*.safetensors"))[-1]
    with open(shard, "ab") as f:
        f.write(b"\0" * 64)
    err = _refused(tiny, pool, other)
    assert isinstance(err, CheckpointError)
    assert "expert worker 1" in err.message and "sizes or headers" in err.message
