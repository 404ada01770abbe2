"""Grammars on llguidance: compiled for a tokenizer, a matcher per generation.

llguidance (PyPI ``llguidance``) computes the set of ids a grammar allows next over the
whole vocabulary, byte-exactly for any tokenization, with special tokens named by id
(``<[163587]>`` in a Lark grammar), and the ids a grammar forces (its canonical
tokenization of fixed text). It was chosen by measurement against xgrammar and
outlines-core at the released 163,840-id vocabulary
(``docs/measurements/2026-12-05-constraint-masks.md``): under a millisecond to compile a
schema, tens of microseconds a mask, and it alone takes special tokens inside a grammar,
which the XTML tool-call grammar needs.

:func:`lark_grammar` checks a Lark grammar against a tokenizer and refuses one that does
not compile (a :class:`~k3core.api.errors.UsageError` quoting llguidance's message);
:class:`GrammarConstraint` is one generation's matcher, a
:class:`~k3core.model.constraint.Constraint`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.constrain.schema import check_schema
from k3core.tokenizer.encoding import Tokenizer

#: JSON as k3 constrains it: no free whitespace, compact separators (as the XTML encoder
#: writes a schema); a model cannot spend its tokens on spaces
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
#: JSON as the XTML encoder writes a tool argument's value (Python's ``json.dumps``)
SPACED_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a core dependency
        raise UsageError("constrained decoding needs the llguidance package: "
                         "pip install llguidance") from None
    return llguidance


@lru_cache(maxsize=4)
def ll_tokenizer(tok: Tokenizer) -> Any:
    """llguidance's view of ``tok`` (about a second at the released vocabulary; kept)."""
    from llguidance.tiktoken import lltokenizer_from_encoding

    eos = tok.special_tokens.get("[EOS]", tok.vocab_size - 1)
    return lltokenizer_from_encoding(tok.encoding, n_vocab=tok.vocab_size, eos_token=eos)


def json_value(schema: dict[str, Any], options: dict[str, Any] | None = None) -> str:
    """A Lark rule body for one JSON value of ``schema`` (checked against the subset), written
    as ``options`` say (:data:`JSON_OPTIONS` by default)."""
    check_schema(schema)
    return "%json " + json.dumps({**schema, "x-guidance": options or JSON_OPTIONS}, ensure_ascii=False)


def json_grammar(schema: dict[str, Any]) -> str:
    """A Lark grammar for exactly one JSON value of ``schema``."""
    return f"start: {json_value(schema)}\n"


def special(token_id: int) -> str:
    """A special token, by id, in a Lark grammar."""
    return f"<[{int(token_id)}]>"


def literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def lark_grammar(lark: str, tok: Tokenizer, what: str = "the grammar") -> str:
    """llguidance's grammar for the Lark text ``lark``, checked against ``tok``."""
    llg = _llg()
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    is_err, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tok))
    if is_err:
        first = (messages[0] if messages else "it does not compile").strip().splitlines()
        raise UsageError(f"{what} does not compile: {' '.join(s.strip() for s in first[:3])}")
    return str(grammar)


def gbnf_to_lark(gbnf: str) -> str:
    """A GBNF grammar (llama.cpp's) as Lark text; refused if it does not convert."""
    _llg()
    from llguidance.gbnf_to_lark import gbnf_to_lark as convert

    try:
        return str(convert(gbnf))
    except Exception as e:  # llguidance raises its own error types
        raise UsageError(f"the GBNF grammar does not convert: {e}") from None


class GrammarConstraint:
    """One generation's matcher over a compiled grammar (a ``Constraint``)."""

    def __init__(self, grammar: str, tok: Tokenizer):
        llg = _llg()
        import llguidance.numpy as llnp

        self._np = llnp
        self.vocab = tok.vocab_size
        self.matcher = llg.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
        if self.matcher.is_error():
            raise UsageError(f"the grammar does not compile: {self.matcher.get_error()}")
        self._mask = llnp.allocate_token_bitmask(1, self.vocab)
        self.fast_forward = True

    def allowed(self) -> np.ndarray:
        self._np.fill_next_token_bitmask(self.matcher, self._mask)
        self._check()
        bits = np.unpackbits(self._mask[0].view(np.uint8), bitorder="little")[: self.vocab]
        return np.flatnonzero(bits)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            self._check()
            raise K3Error(f"constrained decoding: the grammar refused token {token}")

    def forced(self) -> list[int]:
        if not self.fast_forward or self.matcher.is_stopped():
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()]

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise K3Error(f"constrained decoding: {self.matcher.get_error()}")
