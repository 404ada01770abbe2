"""``python -m k3core.cli`` and the ``k3`` script: the command line.

Ctrl-C while the command line is still importing, or once its command has returned, is
one line and exit 130 (``k3core.cli.interrupts``), never a traceback.
"""

from k3core.cli.interrupts import quiet_until_command


def main() -> None:
    quiet_until_command()
    from k3core.cli.app import main as app_main

    try:
        app_main()
    finally:
        # the command has closed what it opened: Ctrl-C while the interpreter shuts down is
        # the same one line and exit 130, not a traceback from a finaliser
        quiet_until_command()


if __name__ == "__main__":
    main()
