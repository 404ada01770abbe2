"""Every command's ``--help`` shows each help text as written: typer renders help as rich
markup, which ate a bracketed word (``needs k3[ray]`` showed as ``needs k3``)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from k3core.cli.app import COMMANDS, app

runner = CliRunner()
#: wide enough that no help text wraps, so each one reads as one run of words
WIDE = {"COLUMNS": "4000", "TERMINAL_WIDTH": "4000", "NO_COLOR": "1"}


def _source_command(name: str) -> Any:
    """The click command built straight from the command's module, with the help strings
    exactly as the source writes them (not through the app's loader)."""
    module_name, _ = COMMANDS[name]
    sub = typer.Typer()
    importlib.import_module(f"k3core.cli.{module_name}").register(sub)
    return typer.main.get_group(sub).commands[name]


def _walk(path: list[str], cmd: Any) -> Iterator[tuple[list[str], Any]]:
    yield path, cmd
    for sub_name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from _walk([*path, sub_name], sub)


def _every_command() -> list[tuple[list[str], Any]]:
    return [pc for name in COMMANDS for pc in _walk([name], _source_command(name))]


def _flat(text: str) -> str:
    """The rendered help as one line of words: box edges and wrapping removed."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize("path, cmd", _every_command(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_help_shows_every_text_unmangled(path: list[str], cmd: Any) -> None:
    res = runner.invoke(app, [*path, "--help"], env=WIDE)
    assert res.exit_code == 0, res.output
    shown = _flat(res.output)
    texts = [p.help for p in cmd.params if getattr(p, "help", None)]
    if cmd.help:
        texts.append(cmd.help.split("\n\n")[0])  # the first paragraph at least
    assert texts, path
    for text in texts:
        assert _flat(text) in shown, f"k3 {' '.join(path)} --help mangles {text!r}"


def test_bracketed_words_survive() -> None:
    """The cases that were eaten, and one rich never took for a tag (kept either way)."""
    run = _flat(runner.invoke(app, ["run", "--help"], env=WIDE).output)
    assert "needs k3[ray])." in run
    pack = _flat(runner.invoke(app, ["pack-trunk", "--help"], env=WIDE).output)
    assert "Lossless codec NAME[:LEVEL]: none" in pack
