"""How many malloc arenas the process keeps: few, so threads do not multiply the heap.

glibc gives each thread that allocates while another holds an arena a new arena, up to eight
per core, and an arena keeps the pages of what was freed in it for its next allocations.
A batched engine allocates a pass's activations on whichever thread leads the pass (a
server's slot threads, ``generate_batch``'s threads), so every leader's arena grows to a
pass's temporaries and keeps them: on the medium model streamed at ``--trunk-gb 0.2
--cache-gb 0.2``, eight prompts of a batch file (``k3 run --batch-file --max-batch 8``)
peaked at 846-897 MB against a memory plan of 786 MB; with two arenas at 795 MB, and at 935
against 954 MB for sixteen (the plan's buffers row holds one pass's temporaries, not one per
thread).

:func:`limit_arenas` caps the arenas at :data:`ARENAS` with glibc's ``mallopt`` before the
engine starts its threads. A ``MALLOC_ARENA_MAX`` in the environment is the user's choice
and is left alone; elsewhere (another C library, another OS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: the arenas a k3 process keeps (the main thread's and one more)
ARENAS = 2
#: glibc's ``mallopt`` parameter for the arena cap (malloc.h)
M_ARENA_MAX = -8

_done: bool | None = None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` (once a process; later calls return the first
    answer). ``True`` when the cap is in force (set here, or by ``MALLOC_ARENA_MAX``)."""
    global _done
    if _done is not None:
        return _done
    if os.environ.get("MALLOC_ARENA_MAX"):
        _done = True
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        glibc = hasattr(libc, "gnu_get_libc_version")  # musl has no arenas to cap
    except (OSError, AttributeError):
        return _done
    if not glibc:
        return _done
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = mallopt(M_ARENA_MAX, arenas) == 1
    return _done
