"""The coverage-guided fuzz harnesses in ``fuzz/`` stay runnable without atheris.

Each harness's ``one_input`` is fed its seed corpus and a few hundred seeded mutations of it
(truncations, flipped bytes, spliced junk); none may raise (a refusal is a ``K3Error`` the
harness absorbs). ``make fuzz`` runs the same harnesses under atheris for real.
"""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import pytest

FUZZ_DIR = Path(__file__).resolve().parents[2] / "fuzz"
TARGETS = sorted(p.stem for p in FUZZ_DIR.glob("fuzz_*.py") if p.stem != "fuzz_common")
MUTATIONS = 300


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        common = importlib.import_module("fuzz_common")
        common.BUILD = tmp_path_factory.mktemp("fuzz-build")  # not the checkout's build/
        yield {t: importlib.import_module(t) for t in TARGETS}
    finally:
        sys.path.remove(str(FUZZ_DIR))


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        pos = rng.randrange(len(b) + 1)
        if op == 0:
            del b[pos:]
        elif op == 1 and b:
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 2:
            b[pos:pos] = rng.randbytes(rng.randint(1, 8))
        else:
            b[pos:pos] = rng.choice([b"{", b"]", b"\x00", b"\xff", b'"', b"-1", b"1e999", b"\n"])
    return bytes(b)


def test_every_target_has_a_harness() -> None:
    assert {t.removeprefix("fuzz_") for t in TARGETS} >= {
        "safetensors", "config", "tiktoken", "tokenizer_config", "manifest", "trace", "preset",
        "window_codec"}


@pytest.mark.parametrize("target", TARGETS)
def test_harness_runs_on_its_seeds_and_mutations(harnesses, target) -> None:
    h = harnesses[target]
    seeds = h.seeds()
    assert seeds
    rng = random.Random(target)
    for s in seeds:
        h.one_input(s)
    for _ in range(MUTATIONS):
        h.one_input(_mutate(rng, rng.choice(seeds)))
    h.one_input(b"")
