"""``python -m k3core.cli``: the k3 command line."""

from k3core.cli.app import main

main()
