"""The ``k3`` command line (typer), with each command's module imported only when it runs.

The table :data:`COMMANDS` names every command, the module that defines it and its one-line
help; ``k3 --help`` prints the table without importing any command module, and ``k3 run``
imports ``k3core.cli.run`` alone. A command module exposes ``register(app)``, which adds its
command (or command group) to a Typer app; it imports nothing from this module.

Usage errors (a bad value, a missing argument, an unknown option or command) are printed the
way every other refusal is: one ``k3: error: ...`` line on stderr naming the fix, exit 2
(:meth:`LazyGroup.main`); no usage box, no type placeholders.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from k3core import __version__

# name -> (module under k3core.cli, one-line help shown by ``k3 --help``), in help order
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "Generate tokens from MODEL_DIR (greedy unless a sampling flag is given)."),
    "chat": ("chat", "Talk with MODEL_DIR: state carried between turns, /save and /load."),
    "serve": ("serve", "Serve MODEL_DIR over an OpenAI-compatible HTTP API."),
    "synth": ("synth", "Write a deterministic synthetic checkpoint (random weights)."),
    "pack-trunk": ("pack_trunk", "Pack every layer's trunk into one aligned file."),
    "shard-experts": ("shard_experts", "Cut a checkpoint into a head and one expert share per worker."),
    "backends": ("backends", "List every kernel backend, storage backend and cache policy."),
    "presets": ("presets", "List, show and validate memory presets."),
    "doctor": ("doctor", "Check this machine (and a model), then print the next command."),
    "download": ("download", "Fetch a model at a pinned commit, check space, verify."),
    "budget": ("budget", "What is resident, what streams, and each preset's memory plan."),
    "cmp-logits": ("cmp_logits", "Compare two --dump-logits files."),
    "bench-ladder": ("bench_ladder", "The memory ladder (same as k3 bench ladder)."),
    "bench": ("bench", "Measurements next to their yardsticks: kernels, io, ladder."),
    "sim-cache": ("sim_cache", "Replay an expert trace under every cache policy and Belady."),
    "perplexity": ("perplexity", "Mean cross-entropy and perplexity of a text file, in windows."),
    "tune": ("tune", "Pick the fastest settings that keep the ids; write them as a preset."),
}


def load_command(name: str) -> Any:
    """Import the module of ``name`` and build its click command."""
    module_name, _ = COMMANDS[name]
    module = importlib.import_module(f"k3core.cli.{module_name}")
    sub = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
    module.register(sub)
    group = typer.main.get_group(sub)
    return literal_help(group.commands[name])


def literal_help(cmd: Any) -> Any:
    """Make ``cmd``'s help texts (its own, its options' and its subcommands') plain text:
    typer reads them as rich markup, which would eat a bracketed word (``k3[ray]`` showed
    as ``k3``). Only what rich would take for a tag is escaped."""
    from rich.markup import escape

    for param in getattr(cmd, "params", ()):
        if isinstance(getattr(param, "help", None), str):
            param.help = escape(param.help)
    for attr in ("help", "short_help", "epilog"):
        if isinstance(getattr(cmd, attr, None), str):
            setattr(cmd, attr, escape(getattr(cmd, attr)))
    for sub in getattr(cmd, "commands", {}).values():
        literal_help(sub)
    return cmd


class LazyGroup(TyperGroup):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS:
            return None
        return load_command(cmd_name)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = [(name, help_) for name, (_, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line; click's usage errors become one ``k3: error:`` line."""
        standalone_mode = bool(kwargs.pop("standalone_mode", True))
        no_args, usage, abort = _click_errors()
        try:
            kwargs["standalone_mode"] = False
            rv = super().main(*args, **kwargs)
        except no_args as exc:  # bare `k3` or a bare group: the help, exit 2
            ctx = getattr(exc, "ctx", None)
            print(ctx.get_help() if ctx is not None else usage_message(exc), file=sys.stderr)
            return _leave(standalone_mode, 2)
        except usage as exc:
            print(f"k3: error: {usage_message(exc)}", file=sys.stderr)
            return _leave(standalone_mode, int(getattr(exc, "exit_code", 2)))
        except abort:
            print("k3: error: interrupted", file=sys.stderr)
            return _leave(standalone_mode, 130)
        code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
        return _leave(standalone_mode, code) if standalone_mode else rv

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name = args[0] if args else ""
        if name and name not in COMMANDS and not name.startswith("-"):
            import difflib

            close = difflib.get_close_matches(name, list(COMMANDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            ctx.fail(f"no such command {name!r}{hint}; k3 --help lists them")
        return super().resolve_command(ctx, args)


def _click_errors() -> tuple[tuple[type[BaseException], ...], ...]:
    """(no-args-is-help, usage-error, abort) classes of the click typer runs on: its own
    vendored copy (``typer._click``, newer typer) and/or the ``click`` package."""
    no_args: list[type[BaseException]] = []
    usage: list[type[BaseException]] = []
    abort: list[type[BaseException]] = []
    for mod_name, abort_mod in (("typer._click.exceptions", "typer.exceptions"),
                                ("click.exceptions", "click.exceptions")):
        if mod_name.startswith("click.") and "click" not in sys.modules:
            continue  # nothing imported the click package, so none of its errors can arise
        try:
            mod = importlib.import_module(mod_name)
            amod = importlib.import_module(abort_mod)
        except ImportError:
            continue
        for bucket, name in ((no_args, "NoArgsIsHelpError"), (usage, "ClickException")):
            cls = getattr(mod, name, None)
            if isinstance(cls, type):
                bucket.append(cls)
        cls = getattr(amod, "Abort", None)
        if isinstance(cls, type):
            abort.append(cls)
    return tuple(no_args), tuple(usage), tuple(abort)


def _leave(standalone_mode: bool, code: int) -> int:
    if standalone_mode:
        sys.exit(code)
    return code


#: type placeholders click and typer put in messages (``<bool>``, ``<list[int]>``)
_PLACEHOLDER = re.compile(r"\s*<[a-z][\w\[\], |]*>")


def usage_message(exc: BaseException) -> str:
    """One line: the problem, then where the flags are described."""
    fmt = getattr(exc, "format_message", None)
    msg = " ".join((fmt() if callable(fmt) else str(exc)).split())
    msg = _PLACEHOLDER.sub("", msg).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and getattr(ctx, "command_path", None) and "--help" not in msg:
        msg += f" (see `{ctx.command_path} --help`)"
    return msg


app = typer.Typer(
    name="k3",
    cls=LazyGroup,
    help="Run Kimi K3 from its released checkpoint: exact at every memory budget.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish

    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"k3 {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """k3: Kimi K3 on one machine."""


def main() -> None:
    app()
