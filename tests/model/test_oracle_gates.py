"""The 13-layer PyTorch oracle: teacher forcing 32/32, greedy full recompute 20/20,
incremental 20/20, and full recompute == incremental to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from k3core.api.experts import InMemoryExperts
from k3core.model.forward import Model
from k3core.model.sources import ModelTables, ResidentTrunk, expert_from_reader
from k3core.model.state import SequenceState
from k3core.run.generate import generate
from k3core.testing.oracle import load_oracle


@pytest.fixture(scope="module")
def oracle(fixtures, numpy_backend):
    cfg, reader, ref = load_oracle(fixtures)
    model = Model(
        cfg,
        numpy_backend,
        ResidentTrunk(cfg, reader, cfg.n_layers),
        ModelTables(cfg, reader),
        InMemoryExperts(lambda L, e: expert_from_reader(cfg, reader, L, e)),
    )
    return model, ref


def test_gate1_teacher_forcing(oracle):
    model, ref = oracle
    full = np.array(ref["full_ids"])
    logits = model.forward(full, SequenceState(model.cfg, len(full)), all_logits=True)
    assert logits.argmax(-1).tolist() == ref["tf_pred"]
    assert np.allclose(logits[:, :8], np.array(ref["logits_head"]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("incremental", [False, True])
def test_gates_2_and_3_greedy(oracle, incremental):
    model, ref = oracle
    run = generate(model, ref["prompt_ids"], 20, incremental=incremental)
    assert run.full_ids == ref["full_ids"]


def test_full_recompute_equals_incremental_bitwise(oracle):
    model, ref = oracle
    a = generate(model, ref["prompt_ids"], 6, incremental=False, keep_logits=True)
    b = generate(model, ref["prompt_ids"], 6, incremental=True, keep_logits=True)
    assert [x.tobytes() for x in a.step_logits] == [x.tobytes() for x in b.step_logits]
