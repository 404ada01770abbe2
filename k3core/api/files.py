"""Reading a file k3 does not trust: a regular file, no larger than a cap, read whole.

Every reader of a small input file (``config.json``, the shard index, ``trunk.json``, the
tokenizer files, presets, prompt files, traces) reads it through :func:`read_capped`, so
each refuses the same things the same way: a missing file, something that is not a regular
file, a file over its cap (checked before reading, and again while reading, in case it
grows), a read error. :class:`FileRejected` carries the reason; the caller raises its own
:class:`~k3core.api.errors.K3Error` subclass with the file's name in front.
"""

from __future__ import annotations

import stat
from pathlib import Path

from k3core.api.units import human


class FileRejected(Exception):
    """Why a file was not read, in words that follow ``"<path>: "``."""


def read_capped(path: str | Path, cap: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``cap`` of them; else :class:`FileRejected`."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise FileRejected("no such file") from None
    except OSError as exc:
        raise FileRejected(f"cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileRejected("not a regular file")
    if st.st_size > cap:
        raise FileRejected(f"{st.st_size:,} bytes is larger than the {human(cap)} limit")
    try:
        with open(p, "rb") as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        raise FileRejected(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > cap:
        raise FileRejected(f"grew past the {human(cap)} limit while being read")
    return data
