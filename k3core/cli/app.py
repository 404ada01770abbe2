"""The ``k3`` command line (typer), with each command's module imported only when it runs.

The table :data:`COMMANDS` names every command, the module that defines it and its one-line
help; ``k3 --help`` prints the table without importing any command module, and ``k3 run``
imports ``k3core.cli.run`` alone. A command module exposes ``register(app)``, which adds its
command (or command group) to a Typer app; it imports nothing from this module.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from k3core import __version__

# name -> (module under k3core.cli, one-line help shown by ``k3 --help``), in help order
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "Generate tokens from MODEL_DIR (greedy unless a sampling flag is given)."),
    "synth": ("synth", "Write a deterministic synthetic checkpoint (random weights)."),
    "pack-trunk": ("pack_trunk", "Pack every layer's trunk into one aligned file."),
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
}


def load_command(name: str) -> Any:
    """Import the module of ``name`` and build its click command."""
    module_name, _ = COMMANDS[name]
    module = importlib.import_module(f"k3core.cli.{module_name}")
    sub = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
    module.register(sub)
    group = typer.main.get_group(sub)
    return group.commands[name]


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

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name = args[0] if args else ""
        if name and name not in COMMANDS and not name.startswith("-"):
            import difflib

            close = difflib.get_close_matches(name, list(COMMANDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            ctx.fail(f"no such command {name!r}{hint}; k3 --help lists them")
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="k3",
    cls=LazyGroup,
    help="Run Kimi K3 from its released checkpoint: exact at every memory budget.",
    no_args_is_help=True,
    add_completion=False,
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
