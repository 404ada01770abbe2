"""A batched step: several sequences at different positions in one pass, each row's logits the
bytes of the same sequence run alone (k3core/model/forward.py ``forward_many``,
k3core/model/scheduler.py), on every kernel backend at 1, 2 and 3 threads with the parallel
paths forced, whatever else shares the pass, however a prompt is chunked, when rows join and
leave, and when the passes are asked from threads at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from thin import SLOW

from k3core.model.config import ModelConfig
from k3core.model.segments import Feed
from k3core.model.shapes import size_config
from k3core.model.state import SequenceState
from k3core.plugins.registry import get_registry
from k3core.run.engine import open_engine
from k3core.run.request import EngineRequest
from k3core.tools.synth.writer import synthesize

#: five sequences: a prompt each, then the ids fed one at a time after it (teacher-forced, so
#: the reference does not depend on a pick)
PROMPTS = [[3, 7, 11, 5], [9], [2, 14, 8, 1, 6, 6, 30, 4, 12], [40, 41], [5, 3, 7, 11, 5, 2]]
FOLLOW = [[4, 6, 8, 10, 12], [1, 2, 3], [7, 7, 7, 7], [9, 8, 7, 6, 5, 4], [0, 1]]


def _kernels() -> list[str]:
    reg = get_registry()
    return [n for n in ("numpy", "numba", "avx2")
            if n in reg.names("kernel") and reg.probe("kernel", n).ok]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("batched") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=11)


def _open(model, backend: str = "numpy", threads: int = 1):
    return open_engine(EngineRequest(model_dir=model, backend=backend, storage="plain",
                                     threads=threads))


def _alone(eng) -> list[list[bytes]]:
    """Each sequence alone: its prompt's last row, then each following id's row."""
    out = []
    for prompt, follow in zip(PROMPTS, FOLLOW, strict=True):
        st = SequenceState(eng.cfg, len(prompt) + len(follow))
        rows = [eng.model.forward(np.array(prompt), st)[-1].tobytes()]
        rows += [eng.model.forward(np.array([i]), st)[-1].tobytes() for i in follow]
        out.append(rows)
    return out


def _staggered(eng) -> list[list[bytes]]:
    """The same sequences in batched passes: sequence i joins at pass i (its whole prompt in
    the pass it joins), each leaves after its last id; every pass holds whoever is running."""
    m = eng.model
    states = [SequenceState(eng.cfg, len(p) + len(f)) for p, f in zip(PROMPTS, FOLLOW, strict=True)]
    feeds_left = [[list(p)] + [[i] for i in f] for p, f in zip(PROMPTS, FOLLOW, strict=True)]
    got: list[list[bytes]] = [[] for _ in PROMPTS]
    step = 0
    while any(feeds_left):
        running = [i for i in range(len(PROMPTS)) if i <= step and feeds_left[i]]
        feeds = [Feed(np.array(feeds_left[i].pop(0)), states[i], 1) for i in running]
        for i, out in zip(running, m.forward_many(feeds), strict=True):
            got[i].append(out[-1].tobytes())
        step += 1
    return got


@pytest.mark.parametrize("backend", _kernels())
@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=SLOW), 3])
def test_rows_in_a_batched_pass_are_their_lone_bytes(model, monkeypatch, backend, threads):
    want = _alone(_open(model))  # the numpy reference, one thread
    monkeypatch.setenv("K3_FORCE_PARALLEL", "1")
    eng = _open(model, backend, threads)
    try:
        assert _staggered(eng) == want
    finally:
        eng.close()


def test_all_rows_of_a_pass_and_a_chunked_prompt_keep_their_bytes(model):
    """A prompt asked for every row's logits beside decoding rows, and one fed in chunks while
    others decode: the same bytes as alone."""
    eng = _open(model)
    m = eng.model
    try:
        lone = SequenceState(eng.cfg, 9)
        want = m.forward(np.array(PROMPTS[2]), lone, all_logits=True)
        a, b = SequenceState(eng.cfg, 9), SequenceState(eng.cfg, 6)
        m.forward(np.array([3, 7]), b)
        outs = m.forward_many([Feed(np.array(PROMPTS[2]), a, 9), Feed(np.array([11]), b, 1)])
        assert outs[0].tobytes() == want.tobytes()
        c, d = SequenceState(eng.cfg, 9), SequenceState(eng.cfg, 12)
        m.forward(np.array([3, 7]), d)
        parts = []
        for lo, hi in ((0, 4), (4, 5), (5, 9)):  # the prompt in three chunks, d stepping along
            parts.append(m.forward_many([Feed(np.array(PROMPTS[2][lo:hi]), c, hi - lo),
                                         Feed(np.array([lo + 1]), d, 1)])[0])
        assert np.concatenate(parts).tobytes() == want.tobytes()
    finally:
        eng.close()


def test_threads_asking_at_once_are_batched_and_keep_their_bytes(model):
    eng = _open(model)
    want = _alone(eng)
    m = eng.model
    got: list[list[bytes]] = [[] for _ in PROMPTS]
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS))

    def run(i: int) -> None:
        try:
            with m.scheduler.running():
                start.wait()
                st = SequenceState(eng.cfg, len(PROMPTS[i]) + len(FOLLOW[i]))
                got[i].append(m.forward(np.array(PROMPTS[i]), st)[-1].tobytes())
                for t in FOLLOW[i]:
                    got[i].append(m.forward(np.array([t]), st)[-1].tobytes())
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    m.scheduler.gather = 1.0  # generous: a slow test machine still batches
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert got == want
        assert m.scheduler.stats.most == len(PROMPTS), "the first passes hold every sequence"
    finally:
        eng.close()


def test_a_failed_pass_fails_every_row_in_it_and_the_model_goes_on(model):
    eng = _open(model)
    m = eng.model
    try:
        a, b = SequenceState(eng.cfg, 4), SequenceState(eng.cfg, 4)
        real = m.trunk.acquire

        def broken(layer):
            raise OSError("a read failed")

        m.trunk.acquire = broken  # type: ignore[method-assign]
        with pytest.raises(OSError):
            m.forward_many([Feed(np.array([1, 2]), a, 1), Feed(np.array([3]), b, 1)])
        m.trunk.acquire = real  # type: ignore[method-assign]
        fresh = SequenceState(eng.cfg, 4)
        assert m.forward(np.array([3]), fresh).shape == (1, eng.cfg.vocab)
        with pytest.raises(ValueError, match="share a state"):
            m.forward_many([Feed(np.array([1]), fresh, 1), Feed(np.array([2]), fresh, 1)])
    finally:
        eng.close()


def test_a_sequence_that_stops_asking_holds_back_one_gather_only(model):
    """A running sequence that stops asking (an abandoned stream, on a thread of its own)
    costs the next pass one gather; the passes after it run at once."""
    import time

    eng = _open(model)
    m = eng.model
    entered, leave = threading.Event(), threading.Event()

    def abandoned() -> None:
        with m.scheduler.running():  # one pass, then registered and never asking again
            m.forward(np.array([5]), SequenceState(eng.cfg, 2))
            entered.set()
            leave.wait(60)

    other = threading.Thread(target=abandoned)
    try:
        m.scheduler.gather = 0.5
        other.start()
        assert entered.wait(10)
        with m.scheduler.running(), m.scheduler.running():  # nested: still one sequence
            assert m.scheduler.active == 2
            st = SequenceState(eng.cfg, 8)
            t0 = time.monotonic()
            m.forward(np.array([3, 7]), st)
            first = time.monotonic() - t0
            t0 = time.monotonic()
            for i in range(4):
                m.forward(np.array([i + 1]), st)
            rest = time.monotonic() - t0
        assert first >= 0.5 and rest < 0.5 * 4 / 2, (first, rest)
    finally:
        leave.set()
        other.join(10)
        eng.close()
    assert m.scheduler.active == 0


def _on_threads(run, n: int) -> list[BaseException]:
    """``run(i)`` for i < n, each on a thread of its own, all joined; what they raised."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            run(i)
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_streams_that_ask_a_little_late_stay_in_one_batch(model):
    """Sequences whose work between two passes takes longer than the least gather (many
    threads sharing one interpreter) are still waited for, up to a share of the last
    pass: they do not split into groups whose passes alternate."""
    eng = _open(model)
    m = eng.model
    n, steps = 4, 6
    start = threading.Barrier(n)

    def run(i: int) -> None:
        import time
        with m.scheduler.running():
            start.wait()
            st = SequenceState(eng.cfg, 2 + steps)
            m.forward(np.array([3, 7 + i]), st)
            for k in range(steps):
                time.sleep(0.01 * i)  # a later row's between-token work is longer
                m.forward(np.array([k + 1]), st)

    m.scheduler.gather = 0.001  # the least gather shorter than the stragglers' delays
    m.scheduler.share = 1e3  # this tiny model's passes, weighted as a big model's
    m.scheduler._last_pass = 1.0  # the newcomers' first pass: the arrival window is the most
    try:
        errors = _on_threads(run, n)
        assert not errors, errors
        st = m.scheduler.stats
        assert st.rows == n * (2 + steps)
        assert st.passes == 1 + steps, st  # every pass holds every row (a split adds passes)
    finally:
        eng.close()


def test_a_burst_of_newcomers_on_an_idle_model_shares_its_first_pass(model):
    """Requests that reach an idle model a few milliseconds apart go in one pass: the first
    waits a share of the last pass for the others instead of taking the model alone."""
    import time

    eng = _open(model)
    m = eng.model
    n = 4
    try:
        with m.scheduler.running():  # one earlier pass, so the scheduler knows a pass's cost
            m.forward(np.array([3]), SequenceState(eng.cfg, 2))
        m.scheduler._last_pass = 1.0  # a pass as slow as a big model's: the window is the most

        def run(i: int) -> None:
            time.sleep(0.005 * i)  # arriving over 15 ms
            with m.scheduler.running():
                m.forward(np.array(PROMPTS[i % len(PROMPTS)]), SequenceState(eng.cfg, 12))

        before = m.scheduler.stats.passes
        errors = _on_threads(run, n)
        assert not errors, errors
        assert m.scheduler.stats.passes - before == 1 and m.scheduler.stats.last == n
    finally:
        eng.close()
