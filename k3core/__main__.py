"""``python -m k3core``: the k3 command line."""

from k3core.cli.__main__ import main

main()
