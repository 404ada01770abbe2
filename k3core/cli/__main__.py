"""``python -m k3core.cli`` and the ``k3`` script: the command line.

Ctrl-C while the command line is still importing, or once its command has returned, is
one line and exit 130 (``k3core.cli.interrupts``), never a traceback.

A command interrupted by Ctrl-C has closed what it opened and printed its one line by the
time ``main`` sees exit 130; the process then ends at once with that code. It must: CPython
marks a ``KeyboardInterrupt`` as unhandled whenever one leaves code run by ``exec`` or
``eval`` of a string (which every ``dataclass`` and ``namedtuple`` definition does while the
command's modules import), even if a caller catches it later, and at exit such a process
kills itself with SIGINT instead of returning 130 (about one Ctrl-C in seven landed there in
the test that sends one while the libraries import).
"""

import os
import sys

from k3core.cli.interrupts import quiet_until_command

#: the exit code of a command interrupted by Ctrl-C (128 + SIGINT)
INTERRUPTED = 130


def main() -> None:
    quiet_until_command()
    from k3core.cli.app import main as app_main

    try:
        app_main()
    except SystemExit as exc:
        if exc.code == INTERRUPTED:
            _end_interrupted()
        raise
    finally:
        # the command has closed what it opened: Ctrl-C while the interpreter shuts down is
        # the same one line and exit 130, not a traceback from a finaliser
        quiet_until_command()


def _end_interrupted() -> None:
    """Flush what was printed and leave with 130 (see the module docstring)."""
    quiet_until_command()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say
            pass
    os._exit(INTERRUPTED)


if __name__ == "__main__":
    main()
