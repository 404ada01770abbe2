"""``k3 run --json-schema FILE`` and ``--grammar FILE`` through the real CLI: the text is one
value of the schema (or a sentence of the grammar), refusals are one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from k3core.cli.app import app

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "ok", "n"], "additionalProperties": False}

runner = CliRunner()


def k3(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_json_schema_constrains_the_text(tmp_path):
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(SCHEMA))
    for extra in ([], ["--temperature", "1.2", "--seed", "5"]):
        res = k3("run", DEMO, "--prompt", "def f():\n    return", "--gen", "64", "--json-schema", f,
                 "-q", *extra)
        assert res.exit_code == 0, res.output
        jsonschema.validate(json.loads(res.stdout), SCHEMA)


def test_a_grammar_and_a_gbnf_grammar_constrain_the_text(tmp_path):
    lark = tmp_path / "answer.lark"
    lark.write_text('start: ("yes" | "no") " because " /[a-z]{2,5}/ "."\n')
    res = k3("run", DEMO, "--prompt", "Answer:", "--gen", "32", "--grammar", lark, "-q")
    assert res.exit_code == 0, res.output
    head, _, rest = res.stdout.partition(" because ")
    assert head in ("yes", "no") and rest.endswith(".") and 2 <= len(rest) - 1 <= 5
    gbnf = tmp_path / "ab.gbnf"
    gbnf.write_text('root ::= "a" ("b" | "c")\n')
    res = k3("run", DEMO, "--prompt", "x", "--gen", "8", "--grammar", gbnf, "-q")
    assert res.exit_code == 0 and res.stdout in ("ab", "ac"), res.output


@pytest.mark.parametrize("name, body, flags, needle", [
    ("s.json", json.dumps({"oneOf": [{"type": "string"}]}), ["--json-schema"],
     "'oneOf' is outside the supported subset"),
    ("s.json", "{not json", ["--json-schema"], "not a JSON schema"),
    ("g.lark", "start: /a(/\n", ["--grammar"], "the grammar does not compile"),
    ("missing.json", None, ["--json-schema"], "no such file"),
    ("s.json", "{}", ["--json-schema", "{f}", "--grammar"], "give --json-schema or --grammar, not both"),
])
def test_refusals_are_one_line_and_exit_2(tmp_path, name, body, flags, needle):
    f = tmp_path / name
    if body is not None:
        f.write_text(body)
    args = [a.replace("{f}", str(f)) for a in flags]
    res = k3("run", DEMO, "--prompt", "x", "--gen", "4", *args, f)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3: error: ") and needle in lines[0], res.stderr
