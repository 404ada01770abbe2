"""Ctrl-C before a command has anything to clean up: one line and exit 130, no traceback.

While the interpreter imports k3 and a command's libraries (numpy, the kernels), nothing is
open and nothing is half-written, so :func:`quiet_until_command` makes SIGINT print
``k3: error: interrupted`` and exit 130 at once. When the command itself starts,
:func:`restore` hands SIGINT back to Python's own handler (``KeyboardInterrupt``), which
``guarded`` turns into the same line after the command has closed and kept what it made;
when the command line's ``main`` returns, the quiet handler is back for the interpreter's
shutdown.
Standard library only: this runs before anything else is imported.
"""

from __future__ import annotations

import _signal  # the C module: no enum conversion, nothing to import
import os
from types import FrameType


def _interrupted(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"k3: error: interrupted\n")
    os._exit(130)


def quiet_until_command() -> None:
    """Install the quiet handler, unless SIGINT is ignored or handled by someone else."""
    try:
        if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
            _signal.signal(_signal.SIGINT, _interrupted)
    except ValueError:  # not the main thread
        pass


def restore() -> None:
    """Give SIGINT back to Python (``KeyboardInterrupt``) if the quiet handler holds it."""
    try:
        if _signal.getsignal(_signal.SIGINT) is _interrupted:
            _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    except ValueError:
        pass
