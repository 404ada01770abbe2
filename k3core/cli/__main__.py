"""``python -m k3core.cli`` and the ``k3`` script: the command line.

Ctrl-C while the command line is still importing is one line and exit 130
(``k3core.cli.interrupts``), never a traceback.
"""

from k3core.cli.interrupts import quiet_until_command


def main() -> None:
    quiet_until_command()
    from k3core.cli.app import main as app_main

    app_main()


if __name__ == "__main__":
    main()
