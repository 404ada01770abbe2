"""Constrained decoding in the session: the choice masked among the exact logits, forced ids
fed several in one pass, the same ids as one pass a token."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import k3
from k3core.api.errors import UsageError
from k3core.constrain.grammar import GrammarConstraint, json_grammar, lark_grammar
from k3core.run.request import GenerationParams

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "tags": {"type": "array", "maxItems": 3, "items": {
        "type": "string", "enum": ["alpha", "beta"]}}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "tags", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    eng = k3.load(DEMO, threads=1)
    yield eng
    eng.close()


def _run(engine, grammar, params, fast_forward=True):
    tok = engine.tokenizer
    c = GrammarConstraint(grammar, tok)
    c.fast_forward = fast_forward
    s = engine.session()
    seen: list[tuple[np.ndarray, np.ndarray]] = []  # (exact logits, allowed ids) at each pick
    passes = []
    s.before_step = passes.append

    def around(pick):
        def wrapped(logits):
            seen.append((logits.copy(), c.allowed()))
            return pick(logits)
        return wrapped

    prompt = tok.encode("def main():\n    data = ", allow_special=False)
    ids = [st.token for st, _ in s.steps(prompt, params, around, c) if st is not None]
    return ids, seen, passes, s.last


def test_greedy_is_the_argmax_over_the_allowed_ids_and_forced_ids_ride_along(engine):
    grammar = lark_grammar(json_grammar(SCHEMA), engine.tokenizer)
    p = GenerationParams(max_tokens=120)
    ids, seen, passes, gen = _run(engine, grammar, p)
    assert gen.stop_reason == "stop"
    value = json.loads(engine.tokenizer.decode(ids))
    jsonschema.validate(value, SCHEMA)
    picked = [t for t in ids]  # every pick is the lowest id of the allowed maxima
    k = 0
    for logits, allowed in seen:
        best = allowed[np.argmax(logits[allowed])]
        assert best in picked[k:]
        k = picked.index(int(best), k) + 1
    assert len(passes) < len(ids)  # forced ids fed with the next pass
    slow_ids, _, slow_passes, _ = _run(engine, grammar, p, fast_forward=False)
    assert slow_ids == ids and len(slow_passes) == len(ids)


def test_sampling_is_renormalised_over_the_allowed_ids_and_seeded(engine):
    grammar = lark_grammar(json_grammar(SCHEMA), engine.tokenizer)
    p = GenerationParams(max_tokens=120, temperature=1.5, seed=11)
    a, seen, _, gen = _run(engine, grammar, p)
    b, _, _, _ = _run(engine, grammar, p)
    assert a == b and gen.stop_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(a)), SCHEMA)


def test_no_constraint_keeps_the_ids_and_speculation_is_refused_with_one(engine):
    tok = engine.tokenizer
    prompt = tok.encode("def main():\n", allow_special=False)
    p = GenerationParams(max_tokens=12)
    s = engine.session()
    ids = [st.token for st, _ in s.steps(prompt, p) if st is not None]
    assert ids == engine.generate(prompt, max_tokens=12).ids
    with pytest.raises(UsageError, match="spec"):
        list(engine.session().steps(prompt, GenerationParams(max_tokens=4, spec="ngram"), None,
                                    GrammarConstraint(lark_grammar(json_grammar(SCHEMA), tok), tok)))
