"""Token choice: greedy by default, and seeded sampling that truncates, follows the
temperature, differs between seeds, and uses only contract arithmetic (so the same seed
gives the same tokens on every backend and NumPy build)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.api.contract import EXP_COEF, EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E
from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.sampling import Sampler, argmax, exp_d, lane_sum
from k3core.model.shapes import size_config
from k3core.plugins.registry import get_registry
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
RNG = np.random.default_rng(7)
LOGITS = (RNG.standard_normal(64) * 2).astype(np.float32)


def draws(s: Sampler, logits: np.ndarray, n: int) -> Counter:
    return Counter(s(logits) for _ in range(n))


def softmax64(z: np.ndarray) -> np.ndarray:
    e = np.array([math.exp(v - z.max()) for v in z])
    return e / e.sum()


# ---- greedy ------------------------------------------------------------------------------
def test_argmax_ties_go_to_the_lowest_id():
    assert argmax(np.array([1, 3, 3, 2], np.float32)) == 1


def test_temperature_zero_and_top_k_one_are_greedy():
    best = argmax(LOGITS)
    assert set(draws(Sampler(temperature=0, seed=1), LOGITS, 50)) == {best}
    assert set(draws(Sampler(top_k=1, seed=2), LOGITS, 50)) == {best}


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"temperature": float("nan")},
                                {"top_p": 0}, {"top_p": 1.5}, {"top_k": 0}, {"seed": -1}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(UsageError):
        Sampler(**kw)


# ---- seeds, truncation, temperature --------------------------------------------------------
def test_the_same_seed_repeats_and_other_seeds_differ():
    runs = {}
    for seed in range(8):
        smp = Sampler(seed=seed)
        runs[seed] = tuple(smp(LOGITS) for _ in range(40))
    again = Sampler(seed=3)
    assert tuple(again(LOGITS) for _ in range(40)) == runs[3]
    assert len(set(runs.values())) == len(runs)  # every seed its own stream


def test_top_k_never_draws_outside_the_k_largest():
    k = 5
    allowed = set(np.argsort(-LOGITS.astype(np.float64), kind="stable")[:k].tolist())
    seen = draws(Sampler(temperature=3.0, top_k=k, seed=11), LOGITS, 4000)
    assert set(seen) == allowed  # never outside, and each kept id is reachable


def test_top_p_never_draws_outside_the_nucleus():
    logits = np.array([4.0, 3.0, 2.5, 0.0, -1.0, -3.0, 2.9, -0.5], np.float32)
    p = softmax64(logits.astype(np.float64))
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    top_p = 0.8
    nucleus = set(order[: int(np.searchsorted(cum, top_p) + 1)].tolist())
    assert 1 < len(nucleus) < len(logits)
    seen = draws(Sampler(top_p=top_p, seed=5), logits, 4000)
    assert set(seen) == nucleus
    ids, q = Sampler(top_p=top_p).probabilities(logits)
    assert set(ids.tolist()) == nucleus and abs(q.sum() - 1) < 1e-12


def test_frequencies_follow_the_temperature():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    n = 20000
    for t in (0.5, 1.0, 2.0):
        want = softmax64(logits.astype(np.float64) / t)
        seen = draws(Sampler(temperature=t, seed=int(t * 10)), logits, n)
        for i, p in enumerate(want):
            assert abs(seen[i] / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (t, i)
    cold = draws(Sampler(temperature=0.05, seed=1), logits, 2000)
    hot = draws(Sampler(temperature=50.0, seed=1), logits, 2000)
    assert cold[0] == 2000  # a cold sampler is (almost surely) greedy
    assert len(hot) == 5 and min(hot.values()) > 250  # a hot one is nearly uniform


# ---- contract arithmetic only --------------------------------------------------------------
def exp_reference(x: float) -> float:
    """The contract's exp_d, one float at a time in plain Python."""
    if math.isnan(x):
        return math.nan
    if x > EXP_HI:
        return math.inf
    if x < EXP_LO:
        return 0.0
    n = math.floor(x * LOG2E + 0.5)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = EXP_COEF[13]
    for c in reversed(EXP_COEF[:13]):
        p = p * r + c
    return math.ldexp(p, n)


def test_exp_d_is_the_contracts_bit_for_bit():
    xs = np.concatenate([RNG.uniform(-750, 750, 2000), RNG.uniform(-40, 0, 2000),
                         [0.0, -0.0, 709.0, 709.5, -708.0, -708.5, np.inf, -np.inf]])
    got = exp_d(xs)
    want = np.array([exp_reference(float(x)) for x in xs])
    assert got.tobytes() == want.tobytes()


def test_exp_d_matches_the_kernel_backends_exp(numpy_backend):
    x = RNG.uniform(-80, 80, 4096).astype(np.float32)
    assert exp_d(x.astype(np.float64)).astype(np.float32).tobytes() == \
        numpy_backend.exp(x).tobytes()


def test_lane_sum_is_the_contract_order():
    v = RNG.uniform(0, 1, 1000) * 10.0 ** RNG.integers(-8, 8, 1000)
    lanes = [0.0] * 32
    for i, t in enumerate(v):
        lanes[i % 32] += float(t)
    h = 16
    while h:
        for j in range(h):
            lanes[j] += lanes[j + h]
        h //= 2
    assert lane_sum(v) == lanes[0]


def test_sampling_never_calls_the_platform_exp(monkeypatch):
    s = Sampler(temperature=1.3, top_p=0.9, seed=4)
    ref = [s(LOGITS) for _ in range(30)]

    def no(*a, **k):
        raise AssertionError("the platform's exp was used")

    monkeypatch.setattr(np, "exp", no)
    s = Sampler(temperature=1.3, top_p=0.9, seed=4)
    assert [s(LOGITS) for _ in range(30)] == ref


def test_draws_match_a_plain_python_sampler():
    """Everything but the PCG64 stream re-done in plain Python: the same ids, draw by draw."""
    bits = np.random.PCG64(99)
    logits = (RNG.standard_normal(300) * 3).astype(np.float32)
    t, k, top_p = 0.8, 40, 0.95
    s = Sampler(temperature=t, top_k=k, top_p=top_p, seed=99)
    for _ in range(200):
        z = [float(v) / t for v in logits]
        order = sorted(range(len(z)), key=lambda i: (-z[i], i))[:k]
        w = [exp_reference(z[i] - z[order[0]]) for i in order]
        total = lane_sum(np.array(w))
        p = [x / total for x in w]
        cum, keep = 0.0, len(p)
        for j, x in enumerate(p):
            cum += x
            if cum >= top_p:
                keep = j + 1
                break
        w = w[:keep]
        total = lane_sum(np.array(w))
        u = (int(bits.random_raw()) >> 11) * 2.0**-53
        cum, pick = 0.0, order[keep - 1]
        for i, x in zip(order[:keep], w, strict=True):
            cum += x / total
            if cum > u:
                pick = i
                break
        assert s(logits) == pick


# ---- the command line: greedy by default, one seed, one answer on every backend ------------
@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("sampling") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


def run_ids(model: Path, out: Path, *extra: str) -> list[int]:
    res = runner.invoke(app, ["run", str(model), "--ids", "3,7", "--gen", "6", "--out", str(out),
                              *extra])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())["generated_ids"]


def test_greedy_is_the_default(model, tmp_path):
    plain = run_ids(model, tmp_path / "a.json")
    assert json.loads((tmp_path / "a.json").read_text())["sampling"] is None
    assert run_ids(model, tmp_path / "b.json", "--top-k", "1", "--seed", "5") == plain
    sampled = {tuple(run_ids(model, tmp_path / f"s{s}.json", "--temperature", "3", "--seed",
                             str(s))) for s in range(4)}
    assert len(sampled) > 1  # the seed matters, so sampling is not argmax in disguise


def test_the_same_seed_gives_the_same_tokens_on_every_backend(model, tmp_path):
    reg = get_registry()
    names = [n for n in ("numpy", "avx2") if n in reg.names("kernel")
             and reg.probe("kernel", n).ok]
    got = {n: run_ids(model, tmp_path / f"{n}.json", "--backend", n, "--temperature", "2",
                      "--top-p", "0.9", "--seed", "17") for n in names}
    assert len(set(map(tuple, got.values()))) == 1, got
