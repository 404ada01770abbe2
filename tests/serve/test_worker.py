"""The server's worker in process: continuing from a kept prefix state gives the same logit
bytes and ids as a fresh run; cancellation and failures leave it usable."""

from __future__ import annotations

import pytest

from k3core.run.prefix_cache import PrefixCache
from k3core.run.request import GenerationParams
from k3core.serve.worker import Job, Worker


@pytest.fixture()
def worker(engine):
    return Worker(engine, 512, PrefixCache(10**8))


def job(ids, n, **kw):
    return Job(list(ids), GenerationParams(max_tokens=n, **kw))


def test_continuing_is_bit_identical_to_a_fresh_pass(worker, engine):
    first = worker.run(job([3, 1, 4, 1, 5], 5))
    assert first.reused == 0 and first.ids == engine.generate([3, 1, 4, 1, 5], max_tokens=5).ids
    longer = [3, 1, 4, 1, 5] + first.ids + [9, 2, 6]
    cont = worker.run(job(longer, 4))
    assert cont.reused == 5 + len(first.ids) - 1
    assert worker.last_generation.first_logits.tobytes() == engine.logits(longer).tobytes()
    assert cont.ids == engine.generate(longer, max_tokens=4).ids
    # the prompt replaces the pending id with another one: everything before it is reused
    swapped = longer + cont.ids[:-1] + [(cont.ids[-1] + 1) % 1000]
    again = worker.run(job(swapped, 3))
    assert again.reused == len(longer) + len(cont.ids) - 1
    assert worker.last_generation.first_logits.tobytes() == engine.logits(swapped).tobytes()
    assert again.ids == engine.generate(swapped, max_tokens=3).ids


def test_sampling_through_the_worker_matches_the_python_api(worker, engine):
    out = worker.run(job([8, 8, 8], 6, temperature=0.9, top_k=50, seed=7))
    assert out.seed == 7
    assert out.ids == engine.generate([8, 8, 8], max_tokens=6, temperature=0.9, top_k=50, seed=7).ids


def test_a_cancelled_job_leaves_a_session_to_continue(worker, engine):
    j = job([2, 7, 1, 8], 50)
    seen = []

    def on_step(step, piece):
        if step is not None:
            seen.append(step.token)
            if len(seen) == 3:
                j.cancel.set()
        return True

    j.on_step = on_step
    out = worker.run(j)
    assert out.finish == "cancelled" and out.ids == seen and len(seen) == 3
    assert worker.cancelled == 1 and worker.last["finish"] == "cancelled"
    longer = [2, 7, 1, 8] + out.ids + [5]
    cont = worker.run(job(longer, 3))
    assert cont.reused == len(longer) - 2
    assert cont.ids == engine.generate(longer, max_tokens=3).ids


def test_a_failure_drops_the_session(worker, engine):
    j = job([1, 2, 3], 5)

    def boom(step, piece):
        raise RuntimeError("client callback failed")

    j.on_step = boom
    with pytest.raises(RuntimeError):
        worker.run(j)
    out = worker.run(job([1, 2, 3, 4], 2))  # from the prompt's kept state [1, 2]: the same bits
    assert out.ids == engine.generate([1, 2, 3, 4], max_tokens=2).ids


def test_a_prompt_over_the_context_is_refused_before_anything_runs(worker):
    from k3core.api.errors import UsageError

    with pytest.raises(UsageError, match="context"):
        worker.run(job([1] * 500, 20))
    with pytest.raises(UsageError, match="empty"):
        worker.run(job([], 2))


@pytest.mark.parametrize("max_batch", [1, 2, 4])
def test_a_jobs_rows_run_at_once_within_the_free_slots(engine, max_batch):
    """n rows decode together as far as free slots allow (never more sequences than the
    server's slots), and every row is the single request with its seed."""
    w = Worker(engine, 512, PrefixCache(10**8), max_batch=max_batch)
    engine.model.scheduler.gather = 1.0  # a slow machine still forms the batch
    before = engine.model.scheduler.stats.most
    engine.model.scheduler.stats.most = 0
    done: list[int] = []
    try:
        j = Job([3, 1, 4, 1, 5], GenerationParams(max_tokens=5, temperature=0.9, seed=40), n=4)
        j.on_row_done = done.append
        out = w.run(j)
    finally:
        most = engine.model.scheduler.stats.most
        engine.model.scheduler.stats.most = max(before, most)
    assert [r.seed for r in out.rows] == [40, 41, 42, 43]
    for i, row in enumerate(out.rows):
        ref = engine.generate([3, 1, 4, 1, 5], max_tokens=5, temperature=0.9, seed=40 + i)
        assert row.ids == ref.ids
    assert sorted(done) == [0, 1, 2, 3]  # each row's end said once
    assert most == min(4, max_batch), most  # rows beside each other, within the slots
    assert w.extra_rows == 0 and w.slots.acquire(blocking=False)  # every slot given back
    w.slots.release()


def test_a_job_waits_for_a_slot_its_rows_hold_and_can_be_cancelled_meanwhile(engine):
    import threading
    import time

    w = Worker(engine, 512, PrefixCache(10**8), max_batch=2)
    engine.model.scheduler.gather = 1.0
    hold, holding = threading.Event(), threading.Event()

    def slow(step, piece) -> bool:  # each row waits until let go: both slots held
        holding.set()
        return hold.wait(30)

    a = Job([3, 1, 4], GenerationParams(max_tokens=2, temperature=0.5, seed=1), n=2)
    a.on_step = slow
    outs: dict[str, object] = {}
    ta = threading.Thread(target=lambda: outs.__setitem__("a", w.run(a)))
    ta.start()
    try:
        assert holding.wait(30)
        deadline = time.monotonic() + 10
        while w.extra_rows < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.extra_rows == 1  # the second row took the other slot
        b = job([5, 5], 2)
        tb = threading.Thread(target=lambda: outs.__setitem__("b", w.run(b)))
        tb.start()
        time.sleep(0.3)
        assert tb.is_alive()  # no free slot: it waits, it does not run a third sequence
        b.cancel.set()
        tb.join(5)
        assert not tb.is_alive() and outs["b"].finish == "cancelled"
    finally:
        hold.set()
        ta.join(30)
    assert [len(r.ids) for r in outs["a"].rows] == [2, 2]
    assert w.run(job([5, 5], 2)).ids == engine.generate([5, 5], max_tokens=2).ids
