"""The engine flags come from one model: every command that opens an engine (``run``,
``chat``, ``serve``, ``tune``, ``bench decode``, ``perplexity``) takes the fields of
``EngineRequest`` as flags with one spelling, one help text, one default and one check, and
names them the same way when it refuses one."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from k3core.cli.app import COMMANDS, app
from k3core.cli.options import FLAGS
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.request import EngineRequest
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
WIDE = {"COLUMNS": "4000", "TERMINAL_WIDTH": "4000", "NO_COLOR": "1"}
#: command -> the engine fields it leaves out (chat, serve and perplexity always decode
#: incrementally; tune takes the budgets, the storage and its candidates)
ENGINE_COMMANDS: dict[tuple[str, ...], set[str]] = {
    ("run",): set(),
    ("chat",): {"incremental"},
    ("serve",): {"incremental"},
    ("bench", "decode"): set(),
    ("perplexity",): {"incremental"},
    ("tune",): set(EngineRequest.options()) - {"trunk", "trunk_gb", "cache_gb", "storage",
                                              "backend", "threads", "expert_readers",
                                              "lookahead"},
}


def _command(path: tuple[str, ...]) -> Any:
    module_name, _ = COMMANDS[path[0]]
    sub = typer.Typer()
    importlib.import_module(f"k3core.cli.{module_name}").register(sub)
    cmd = typer.main.get_group(sub).commands[path[0]]
    for name in path[1:]:
        cmd = cmd.commands[name]
    return cmd


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("flags") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


@pytest.mark.parametrize("path", list(ENGINE_COMMANDS), ids=" ".join)
def test_each_command_takes_every_engine_flag_as_the_model_declares_it(path):
    params = {p.name: p for p in _command(path).params}
    wanted = [n for n in EngineRequest.options() if n != "model_dir"
              and n not in ENGINE_COMMANDS[path]]
    missing = [n for n in wanted if n not in params]
    assert missing == [], f"k3 {' '.join(path)} lacks {missing}"
    for name in wanted:
        p = params[name]
        field = EngineRequest.model_fields[name]
        declared = {d for decl in FLAGS[name] for d in decl.split("/")}
        assert declared <= set(p.opts) | set(p.secondary_opts), (path, name, p.opts)
        first = (field.description or "").split("`")[0].rstrip(".")
        assert p.help.startswith(first), (path, name, p.help)
        if path != ("tune",):  # tune's candidates are lists
            assert p.default == field.default, (path, name)


def test_chat_takes_the_budgets_run_and_serve_take():
    shown = _flat(runner.invoke(app, ["chat", "--help"], env=WIDE).output)
    for flag in ("--trunk-gb", "--cache-gb", "--trunk-ring", "--ultra-low-memory",
                 "--expert-readers", "--lookahead", "--prefill-chunk"):
        assert flag in shown, flag


@pytest.mark.parametrize("path", list(ENGINE_COMMANDS), ids=" ".join)
def test_each_command_refuses_a_bad_engine_value_in_the_same_words(model, path):
    args = [*path, str(model), "--threads", "0"]
    if path == ("perplexity",):
        args.insert(len(path) + 1, str(model / "config.json"))  # FILE, never read here
    if path == ("run",):
        args += ["--ids", "3"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "k3: error: --threads must be >= 1, got 0" in res.output, res.output
