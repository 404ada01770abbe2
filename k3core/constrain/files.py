"""A run's constraint from a file: ``k3 run --json-schema FILE`` or ``--grammar FILE``.

A JSON Schema file (strict JSON, in the supported subset: :mod:`k3core.constrain.schema`)
constrains the generated text to one JSON value of the schema; a grammar file is a Lark
grammar in llguidance's dialect (a file ending in ``.gbnf`` is read as llama.cpp's GBNF and
converted). Both are read and checked before anything large is opened
(:func:`constraint_text`: a missing or unreadable file, bad JSON, a schema outside the
subset, a grammar that does not compile are each a
:class:`~k3core.api.errors.UsageError` naming the file); :func:`make_constraint` compiles
the text for the model's tokenizer once the engine is open.
"""

from __future__ import annotations

from pathlib import Path

from k3core.api.errors import UsageError, param
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, parse_json
from k3core.constrain.grammar import GrammarConstraint, gbnf_to_lark, json_grammar, lark_grammar
from k3core.tokenizer.encoding import Tokenizer

#: the largest schema or grammar file read
MAX_FILE_BYTES = 4 << 20


def constraint_text(json_schema: Path | None, grammar: Path | None) -> str | None:
    """The Lark grammar a run is constrained to (``None``: none), from the files given."""
    if json_schema is not None and grammar is not None:
        raise UsageError(f"give {param('json_schema')} or {param('grammar')}, not both")
    path = json_schema if json_schema is not None else grammar
    if path is None:
        return None
    try:
        data = read_capped(path, MAX_FILE_BYTES)
    except FileRejected as exc:
        raise UsageError(f"{path}: {exc}") from None
    if json_schema is not None:
        try:
            schema = parse_json(data)
        except JSONRejected as exc:
            raise UsageError(f"{path}: not a JSON schema: {exc}") from None
        if not isinstance(schema, dict):
            raise UsageError(f"{path}: a JSON schema must be an object")
        return json_grammar(_checked(schema, path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: the grammar is not UTF-8 text") from None
    lark = gbnf_to_lark(text) if path.suffix == ".gbnf" else text
    _validate(lark, path)
    return lark


def make_constraint(lark: str, tok: Tokenizer) -> GrammarConstraint:
    """One generation's matcher of ``lark`` over ``tok`` (compiled here)."""
    return GrammarConstraint(lark_grammar(lark, tok), tok)


def _checked(schema: dict[str, object], path: Path) -> dict[str, object]:
    from k3core.constrain.schema import check_schema

    check_schema(schema, f"{path}")
    return schema


def _validate(lark: str, path: Path) -> None:
    """Refuse a grammar that does not compile (checked without a tokenizer)."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_err, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_err:
        first = (messages[0] if messages else "it does not compile").strip().splitlines()
        raise UsageError(f"{path}: the grammar does not compile: "
                         f"{' '.join(s.strip() for s in first[:3])}")
