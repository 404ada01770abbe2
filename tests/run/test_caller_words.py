"""Errors in the caller's words: the Python API's messages name its keywords
(``max_tokens must be in 0..4096``), the command line's name its flags (``--gen must be in
0..4096``), for the same refusals; every parameter a message names has a flag."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3
from k3core.api.errors import K3Error, UsageError, param
from k3core.cli.app import app
from k3core.cli.options import FLAG_WORDS, FLAGS
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.request import EngineRequest
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
IDS = [3, 7]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("words") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


@pytest.fixture(scope="module")
def engine(model):
    with k3.load(model, backend="numpy") as eng:
        yield eng


# (keywords of k3.load, words of the Python message; flags of k3 run, words of the CLI's)
LOAD = [
    ({"threads": 0}, "threads must be >= 1, got 0", ["--threads", "0"],
     "--threads must be >= 1, got 0"),
    ({"cache_gb": -1.0}, "cache_gb must be a non-negative number of GB",
     ["--cache-gb", "-1"], "--cache-gb must be a non-negative number of GB"),
    ({"trunk_gb": 1.0}, "trunk_gb needs trunk DIR", ["--trunk-gb", "1"],
     "--trunk-gb needs --trunk DIR"),
    ({"ultra_low_memory": True}, "ultra_low_memory needs trunk DIR",
     ["--ultra-low-memory"], "--ultra-low-memory needs --trunk DIR"),
    ({"layers": 99}, "layers must be in 1..13, got 99", ["--layers", "99"],
     "--layers must be in 1..13, got 99"),
    ({"expert_readers": 0}, "expert_readers must be in 1..64, got 0",
     ["--expert-readers", "0"], "--expert-readers/--readers must be in 1..64, got 0"),
    ({"prefill_chunk": 0}, "prefill_chunk must be >= 1, got 0", ["--prefill-chunk", "0"],
     "--prefill-chunk must be >= 1, got 0"),
    ({"lookahead": "maybe"}, "lookahead must be on, off, attn or out, got 'maybe'",
     ["--lookahead", "maybe"], "--lookahead must be on, off, attn or out, got 'maybe'"),
]

GENERATE = [
    ({"max_tokens": 5000}, "max_tokens must be in 0..4096", ["--gen", "5000"],
     "--gen must be in 0..4096"),
    ({"top_p": 2.0}, "top_p must be in (0, 1], got 2.0", ["--top-p", "2"],
     "--top-p must be in (0, 1], got 2.0"),
    ({"temperature": -1.0}, "temperature must be finite and >= 0", ["--temperature", "-1"],
     "--temperature must be finite and >= 0"),
    ({"spec": "ngram", "spec_width": 0}, "spec_width must be in 1..16, got 0",
     ["--spec", "ngram", "--spec-width", "0"], "--spec-width must be in 1..16, got 0"),
    ({"stop_ids": [99999]}, "stop_ids: id 99999 is outside the vocabulary",
     ["--stop-id", "99999"], "--stop-id: id 99999 is outside the vocabulary"),
]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("keywords, said, flags, shown", LOAD)
def test_load_names_keywords_and_run_names_flags(model, keywords, said, flags, shown):
    with pytest.raises(K3Error) as exc:
        k3.load(model, **keywords)
    assert said in str(exc.value) and "--" not in str(exc.value), str(exc.value)
    res = runner.invoke(app, ["run", str(model), "--ids", "3,7", *flags])
    assert res.exit_code == 2 and shown in _flat(res.output), res.output


@pytest.mark.parametrize("keywords, said, flags, shown", GENERATE)
def test_generate_names_keywords_and_run_names_flags(engine, model, keywords, said, flags,
                                                     shown):
    with pytest.raises(UsageError) as exc:
        engine.generate(IDS, **keywords)
    assert said in str(exc.value) and "--" not in str(exc.value), str(exc.value)
    res = runner.invoke(app, ["run", str(model), "--ids", "3,7", *flags])
    assert res.exit_code == 2 and shown in _flat(res.output), res.output


def test_an_error_renders_its_parameters_either_way():
    exc = UsageError(f"{param('max_tokens')} is {param('cache_gb')}'s",
                     hint=f"a smaller {param('max_tokens')}")
    assert str(exc) == "max_tokens is cache_gb's\n  fix: a smaller max_tokens"
    assert exc.params == ("max_tokens", "cache_gb")
    shown = exc.in_words(FLAG_WORDS)
    assert shown == "--gen is --cache-gb's\n  fix: a smaller --gen"
    assert exc.in_words({}) == str(exc)


def _named_params() -> set[str]:
    """Every ``param("NAME")`` k3core and the plugins write in a message."""
    root = Path(__file__).resolve().parents[2]
    names: set[str] = set()
    for path in [*root.glob("k3core/**/*.py"), *root.glob("k3/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "param" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                names.add(node.args[0].value)
    return names


def test_every_parameter_a_message_names_has_a_flag():
    named = _named_params()
    assert {"max_tokens", "cache_gb", "trunk", "layers"} <= named
    assert sorted(named - set(FLAGS)) == []


def test_every_engine_option_has_a_flag():
    assert sorted(set(EngineRequest.options()) - set(FLAGS)) == []
