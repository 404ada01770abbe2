"""The ``k3`` command line: the typer app (``app``) and one module per command.

Command modules import nothing from ``app``; the app imports them lazily, so ``k3 --help``
loads no numeric library.

May import: everything.
"""
