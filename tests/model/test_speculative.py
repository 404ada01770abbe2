"""Speculative decoding in the model room: the verify pass, the rollback, the ids.

The foundation first: the logits of a multi-row verify pass are, row by row, the bytes of
single steps; a rollback leaves the state (KDA ``S``, conv histories, KV rows, ``pos``)
byte-identical to the plain run's. Then the ids: with drafts that agree, disagree or mix
(a drafter fed from a plain run's own ids), and with the n-gram drafter, on every kernel
backend, incremental and full recompute, greedy and sampled.
"""

from __future__ import annotations

import numpy as np
import pytest
from thin import thinned

from k3core.api.errors import UsageError
from k3core.api.experts import InMemoryExperts
from k3core.model.forward import Model
from k3core.model.rollback import begin, truncate
from k3core.model.sampling import Sampler
from k3core.model.sources import ModelTables, ResidentTrunk, expert_from_reader
from k3core.model.speculative import AutoPolicy, SpecOptions, Speculator, ngram_draft
from k3core.model.state import SequenceState
from k3core.plugins.registry import get_registry
from k3core.run.generate import generate
from k3core.testing.synthetic_model import synthetic_model

PROMPT = [3, 7, 11, 5, 9, 2, 14]
N = 10


def backends() -> list[str]:
    reg = get_registry()
    return [n for n in ("numpy", "numba", "avx2")
            if n in reg.names("kernel") and reg.probe("kernel", n).ok]


def build(name: str) -> Model:
    cfg, reader, _ = synthetic_model("released")
    kernels, _, _ = get_registry().create("kernel", name)
    return Model(cfg, kernels, ResidentTrunk(cfg, reader, cfg.n_layers), ModelTables(cfg, reader),
                 InMemoryExperts(lambda L, e: expert_from_reader(cfg, reader, L, e)))


@pytest.fixture(scope="module", params=thinned(backends(), ("numba", "avx2")))
def model(request: pytest.FixtureRequest) -> Model:
    return build(request.param)


@pytest.fixture(scope="module")
def plain(model: Model) -> list[int]:
    return generate(model, PROMPT, N, incremental=True).generated_ids


def state_bytes(st: SequenceState) -> list[bytes]:
    out = [st.pos.to_bytes(4, "little")]
    for L in sorted(st.kda):
        out += [st.kda[L].S.tobytes()] + [st.kda[L].conv[n].tobytes() for n in "qkv"]
    for L in sorted(st.kv):
        kv = st.kv[L]
        out.append(kv.rows[: st.pos].tobytes())
    return out


def test_verify_rows_are_single_step_bytes(model: Model, plain: list[int]) -> None:
    singles = generate(model, PROMPT, N, incremental=True, keep_logits=True).step_logits
    st = SequenceState(model.cfg, len(PROMPT) + N)
    model.forward(np.array(PROMPT), st)
    k = 5  # feed the first generated id and the next five (all correct) in one pass
    rows = model.forward(np.array(plain[: k + 1]), st, tail=k + 1)
    assert rows.shape[0] == k + 1
    for i in range(k + 1):
        assert rows[i].tobytes() == singles[i + 1].tobytes(), f"row {i}"
    # and a whole prefill with drafts: the prompt rows and the draft rows in one pass
    st2 = SequenceState(model.cfg, len(PROMPT) + N)
    rows = model.forward(np.array(PROMPT + plain[:3]), st2, tail=4)
    for i in range(4):
        assert rows[i].tobytes() == singles[i].tobytes(), f"prefill row {i}"


@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_rollback_leaves_the_plain_state(model: Model, plain: list[int], accepted: int) -> None:
    k = 4
    ref = SequenceState(model.cfg, len(PROMPT) + N)
    model.forward(np.array(PROMPT), ref)
    model.forward(np.array(plain[: 1 + accepted]), ref)  # the pending id + the accepted drafts
    st = SequenceState(model.cfg, len(PROMPT) + N)
    model.forward(np.array(PROMPT), st)
    drafts = plain[1 : 1 + accepted] + [(t + 1) % model.cfg.vocab for t in plain[1 + accepted : 1 + k]]
    begin(st, 1)
    model.forward(np.array(plain[:1] + drafts), st, tail=k + 1)
    truncate(model.k, st, len(PROMPT) + 1 + accepted)
    assert st.trail is None
    assert state_bytes(st) == state_bytes(ref)
    # and the next step from there gives the plain run's bytes
    a = model.forward(np.array([plain[1 + accepted]]), st)
    b = model.forward(np.array([plain[1 + accepted]]), ref)
    assert a.tobytes() == b.tobytes()


def oracle(truth: list[int], wrong_every: int) -> object:
    """A drafter that proposes the plain run's own continuation, every ``wrong_every``-th
    draft altered (0: never)."""
    count = [0]

    def draft(ids: list[int], ngram: int, width: int) -> tuple[list[int], int]:
        full = PROMPT + truth
        at = len(ids)
        out = []
        for t in full[at : at + width]:
            count[0] += 1
            out.append((t + 1) % 256 if wrong_every and count[0] % wrong_every == 0 else t)
        return out, 1

    return draft


CASES = [(True, w) for w in (0, 3, 1)] + [(False, 3)]  # full recompute: the mixed drafts


@pytest.mark.parametrize(("incremental", "wrong_every"), CASES)
@pytest.mark.parametrize("sampled", [False, True])
def test_ids_identical_with_any_drafts(model: Model, incremental: bool, sampled: bool,
                                       wrong_every: int) -> None:
    def pick() -> object:
        return Sampler(temperature=0.8, top_p=0.95, seed=3) if sampled else None

    kw = {"pick": pick()} if sampled else {}
    ref = generate(model, PROMPT, N, incremental=incremental, keep_logits=True, **kw)
    spec = Speculator(model, SpecOptions("ngram", 4, 3), drafter=oracle(ref.generated_ids, wrong_every))
    kw = {"pick": pick()} if sampled else {}
    got = generate(model, PROMPT, N, incremental=incremental, keep_logits=True, spec=spec, **kw)
    assert got.generated_ids == ref.generated_ids
    assert [x.tobytes() for x in got.step_logits] == [x.tobytes() for x in ref.step_logits]
    s = got.spec
    assert s is not None and s.emitted == N
    if wrong_every == 0:
        assert s.accepted == s.proposed > 0 and s.passes < N
    if wrong_every == 1:
        assert s.accepted == 0 and s.passes == N


def test_ngram_drafter_ids_identical(model: Model) -> None:
    prompt = [3, 7, 11, 5, 9] * 3
    ref = generate(model, prompt, N, incremental=True)
    got = generate(model, prompt, N, incremental=True, spec=SpecOptions("ngram", 4, 3))
    assert got.generated_ids == ref.generated_ids
    assert got.spec is not None and got.spec.proposed > 0


def test_stops_and_length_hold_with_accepted_drafts(model: Model, plain: list[int]) -> None:
    spec = Speculator(model, SpecOptions("ngram", 8, 3), drafter=oracle(plain, 0))
    got = generate(model, PROMPT, 5, incremental=True, spec=spec)
    assert got.generated_ids == plain[:5]
    stop = plain[3]
    ref = generate(model, PROMPT, N, incremental=True, stop_ids=[stop])
    spec = Speculator(model, SpecOptions("ngram", 8, 3), drafter=oracle(plain, 0))
    got = generate(model, PROMPT, N, incremental=True, stop_ids=[stop], spec=spec)
    assert got.generated_ids == ref.generated_ids and got.stopped_at == stop
    assert got.generated_ids[-1] == stop


def test_ngram_lookup() -> None:
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3], 3, 4) == ([9, 1, 2, 3], 3)
    assert ngram_draft([1, 2, 3, 9, 5, 2, 3], 3, 2) == ([9, 5], 2)  # the longest suffix
    assert ngram_draft([4, 1, 8, 1, 6, 1], 3, 2) == ([6, 1], 1)  # the most recent occurrence
    assert ngram_draft([1, 2, 3], 3, 4) == ([], 0)
    assert ngram_draft([5], 3, 4) == ([], 0)
    assert ngram_draft([5, 5], 3, 4) == ([5], 1)


def test_auto_policy_turns_off_and_back_on() -> None:
    p = AutoPolicy()
    assert p.choose(4) == (0, "measure")
    p.timed(0, 1.0)
    assert p.choose(4) == (4, "probe")
    p.timed(4, 1.4)  # a draft row costs 0.1 of a step
    for _ in range(10):
        p.observe(4, 0)  # every draft rejected
    assert p.choose(4) == (0, "off")
    for _ in range(10):
        p.observe(1, 1)  # the drafter's first id keeps being right while off
    k, why = p.choose(4)
    assert why == "pays" and k == 4
    for _ in range(10):
        p.timed(4, 9.0)  # draft rows turn expensive: off, then a probe re-times them
    assert p.choose(4) == (0, "off")
    for _ in range(p.reprobe - 1):
        assert p.choose(4) == (0, "off")
    assert p.choose(4) == (4, "probe")
    p.timed(0, 50.0)  # one slow plain step on a busy machine does not swing the median
    assert p.t1 == 1.0


@pytest.mark.parametrize("bad", [{"mode": "on"}, {"width": 0}, {"width": 99}, {"ngram": 0},
                                 {"ngram": 9}])
def test_bad_options_refused(bad: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        SpecOptions(**{"mode": "ngram", **bad})  # type: ignore[arg-type]
