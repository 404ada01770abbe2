"""The permission bits of a file k3 creates: ``0666`` less the process's umask.

Files written under a temporary name (``tempfile.mkstemp`` creates them ``0600``) and then
renamed into place get these bits first, so every output honours the umask as a plain
``open(..., "w")`` would.
"""

from __future__ import annotations

import contextlib
import os


def new_file_mode() -> int:
    """``0666`` less this process's umask (read without changing it where Linux allows)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: read it by setting it (and put it back at once)
    os.umask(mask)
    return 0o666 & ~mask


def give_new_file_mode(fd: int) -> None:
    """Set ``fd``'s mode to :func:`new_file_mode` (where the platform has ``fchmod``)."""
    if hasattr(os, "fchmod"):
        os.fchmod(fd, new_file_mode())
