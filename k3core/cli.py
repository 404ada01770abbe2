"""The ``k3`` command line (typer). Each command lives in ``k3core.commands``.

Every refusal is a ``K3Error``: the message is printed once to stderr as ``k3: error: ...``
and the process exits with the error's code (see ``docs/exit-codes.md``). Ctrl-C stops
cleanly with exit 130 after output files are either complete or absent.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from k3core import __version__
from k3core.errors import K3Error

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="k3",
    help="Run Kimi K3 from its released checkpoint: exact at every memory budget.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def fail(message: str, code: int) -> typer.Exit:
    print(f"k3: error: {message}", file=sys.stderr)
    return typer.Exit(code)


def guarded(fn: F) -> F:
    """Turn K3Error into one message and its exit code; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except K3Error as exc:
            raise fail(str(exc), int(exc.exit_code)) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]


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


def _register() -> None:
    from k3core.commands import (
        backends,
        bench,
        bench_ladder,
        budget,
        cmp_logits,
        doctor,
        download,
        pack_trunk,
        presets,
        run,
        sim_cache,
        synth,
    )

    for module in (run, synth, pack_trunk, backends, presets, doctor, download, budget, cmp_logits, bench_ladder, bench,
                   sim_cache):
        module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    # ``python -m k3core.cli``: this file runs as __main__, a second copy of the module; the
    # commands register on (and import ``guarded`` from) the importable ``k3core.cli``
    from k3core.cli import main as _main

    _main()
else:
    _register()
