"""How every command fails: one ``k3: error: ...`` line and the error's exit code.

Every refusal is a ``K3Error``: the message is printed once to stderr, each parameter it
names shown as its flag (``k3core.cli.options.FLAGS``), and the process exits with the
error's code (see ``docs/exit-codes.md``). Ctrl-C stops cleanly with exit 130 after
output files are either complete or absent.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from k3core.api.errors import K3Error
from k3core.cli.interrupts import restore

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int) -> typer.Exit:
    print(f"k3: error: {message}", file=sys.stderr)
    return typer.Exit(code)


def in_flags(exc: K3Error) -> str:
    """``exc``'s message (and fix) with each parameter named as the command line's flag."""
    from k3core.cli.options import FLAG_WORDS

    return exc.in_words(FLAG_WORDS)


def guarded(fn: F) -> F:
    """Turn K3Error into one message and its exit code; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        restore()  # from here on Ctrl-C is a KeyboardInterrupt the command can clean up after
        try:
            return fn(*args, **kwargs)
        except K3Error as exc:
            raise fail(in_flags(exc), int(exc.exit_code)) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]
