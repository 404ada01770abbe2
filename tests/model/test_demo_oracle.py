"""The second oracle: k3 on the shipped demo model agrees with the trainer's own forward pass.

``demo-model/oracle.json`` was exported once from PyTorch (tools/train/oracle.py) on a
held-out snippet. k3, on every kernel backend (numpy reference, numba, avx2), full and
incremental, must pick the same argmax at every position, hold every recorded logit within
1e-4 of the largest logit, and continue the prompt greedily with the same ids; the backends'
logits are the same bytes. No torch needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k3core.model.state import SequenceState
from k3core.run.engine import open_engine
from k3core.run.generate import generate
from k3core.run.request import EngineRequest
from k3core.tokenizer.encoding import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
REL = 1e-4


@pytest.fixture(scope="module")
def oracle():
    return json.loads((DEMO / "oracle.json").read_text())


BACKENDS = ("numpy", "numba", "avx2")


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request):
    eng = open_engine(EngineRequest(model_dir=DEMO, backend=request.param, threads=2))
    yield eng
    eng.close()


def check(logits: np.ndarray, positions: list[dict]) -> None:
    assert logits.shape[0] == len(positions)
    for t, (row, ref) in enumerate(zip(logits, positions, strict=True)):
        assert int(np.argmax(row)) == ref["argmax"], f"position {t}"
        tol = REL * ref["max_abs"]
        for i, v in ref["logits"]:
            assert abs(float(row[i]) - v) <= tol, f"position {t} id {i}: {row[i]} vs {v}"
        assert abs(float(np.abs(row).max()) - ref["max_abs"]) <= tol


def test_full_forward_matches_torch(engine, oracle):
    ids = np.array(oracle["ids"])
    logits = engine.model.forward(ids, SequenceState(engine.cfg, len(ids)), all_logits=True)
    check(logits, oracle["positions"])


def test_incremental_matches_torch(engine, oracle):
    ids = np.array(oracle["ids"])
    st = SequenceState(engine.cfg, len(ids))
    logits = np.concatenate([engine.model.forward(ids[t : t + 1], st) for t in range(len(ids))])
    check(logits, oracle["positions"])


@pytest.mark.parametrize("incremental", [True, False])
def test_greedy_continuation_matches_torch(engine, oracle, incremental):
    run = generate(engine.model, oracle["prompt_ids"], len(oracle["greedy_ids"]),
                   incremental=incremental)
    assert run.generated_ids == oracle["greedy_ids"]


def test_backends_give_the_same_logit_bytes(oracle):
    ids = np.array(oracle["ids"])
    seen = {}
    for backend in BACKENDS:
        for threads in (1, 2):
            with open_engine(EngineRequest(model_dir=DEMO, backend=backend,
                                           threads=threads)) as eng:
                out = eng.model.forward(ids, SequenceState(eng.cfg, len(ids)), all_logits=True)
                seen[backend, threads] = np.ascontiguousarray(out).tobytes()
    assert len(set(seen.values())) == 1, {b: hash(v) for b, v in seen.items()}


def test_the_snippet_is_held_out_text(oracle):
    tok = Tokenizer.from_dir(DEMO)
    text = tok.decode(oracle["ids"])
    assert text.startswith("def ")
    manifest = json.loads((DEMO.parent / "tools" / "train" / "corpus_manifest.json").read_text())
    source, _, path = oracle["snippet_file"].partition("/")
    assert source == "cpython" and path in manifest["held_out"]["stdlib"]
