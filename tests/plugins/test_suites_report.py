"""The kernel and cache suites, as a plugin author meets them in a pytest run of their own:
an exception in a thread the plugin started fails the test (not a warning), a failure says
what differed, and the suites' modules are rewritten by pytest (a bare assert shows values).

One child pytest process (no k3 configuration, like a plugin's own checkout) runs a
generated test file of small broken plugins; each test below reads its report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"

PLUGINS = '''
import random
import sys
import threading

import numpy as np
import pytest
from textbook_policies import FIFOPolicy

from k3.plugin import NumpyBackend
from k3.testing import CachePolicyConformance, KernelConformance


class ThreadyFIFO(FIFOPolicy):
    """begin_token starts a helper thread that dies."""

    def begin_token(self):
        t = threading.Thread(target=lambda: {}["missing"], name="policy-helper")
        t.start()
        t.join()


class CoinFIFO(FIFOPolicy):
    """Evicts a random unprotected expert, from an unseeded generator."""

    def choose_victim(self, protected):
        free = [k for k in self._order if k not in protected]
        return random.SystemRandom().choice(free) if free else None


class Scribbler(NumpyBackend):
    """rmsnorm right, but it scales its input in place."""

    def rmsnorm(self, x, w, eps):
        y = super().rmsnorm(x, w, eps)
        x *= np.float32(2.0)
        return y


class TestThreadyPolicy(CachePolicyConformance):
    factory = ThreadyFIFO


class TestCoinPolicy(CachePolicyConformance):
    factory = CoinFIFO


class TestScribbler(KernelConformance):
    @pytest.fixture
    def backend(self):
        return Scribbler()


def test_the_suites_are_rewritten():
    names = ["k3core.testing.kernel_conformance", "k3core.testing.cache_policy_conformance",
             "k3core.testing.expert_cache_conformance", "k3core.testing.storage_conformance"]
    loaders = {n: type(sys.modules[n].__loader__).__name__ for n in names}
    assert set(loaders.values()) == {"AssertionRewritingHook"}, loaders
'''

SELECT = ("(TestThreadyPolicy and deterministic) or (TestCoinPolicy and deterministic) or "
          "(TestScribbler and rmsnorm and threads1 and not adversarial) or rewritten")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> str:
    work = tmp_path_factory.mktemp("suites-report")
    (work / "test_plugins.py").write_text(PLUGINS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--tb=short", "-k", SELECT, "test_plugins.py"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    return res.stdout + res.stderr


def test_an_exception_in_a_plugins_thread_fails_the_test(report: str) -> None:
    assert re.search(r"ERROR test_plugins\.py::TestThreadyPolicy::test_deterministic", report), report[-3000:]
    assert re.search(r"ThreadFailure: the test: \d+ exception\(s\) escaped a thread \(raised where "
                     r"nothing caught them\); first, in thread 'policy-helper': KeyError: "
                     r"'missing'", report), report[-3000:]


def test_a_nondeterministic_policy_is_told_where(report: str) -> None:
    assert re.search(r"two replays of the same trace decided differently from event \d+ on: "
                     r"\('victim', \d+, \d+\) then \('victim', \d+, \d+\)", report), report[-3000:]


def test_an_op_that_writes_its_input_is_told_which_byte(report: str) -> None:
    assert re.search(r"AssertionError: rmsnorm[^:]*: input 0 was modified \(only the documented "
                     r"in-place state may be\): \d+ of \d+ bytes changed, first at byte \d+: "
                     r"0x[0-9a-f]{2} -> 0x[0-9a-f]{2}", report), report[-3000:]


def test_the_suites_modules_are_rewritten(report: str) -> None:
    assert "test_the_suites_are_rewritten FAILED" not in report
    assert not re.search(r"FAILED test_plugins\.py::test_the_suites_are_rewritten", report), report[-3000:]
    assert re.search(r"\d+ passed", report), report[-3000:]
