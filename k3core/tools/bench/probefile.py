"""The scratch file the disk probe reads: an existing file, or one written for the probe.

Given a directory, :func:`probe_file` writes ``nbytes`` of random (incompressible) data
under a partial name there (:mod:`k3core.api.partials`), flushes it to the device, asks the
OS to drop it from the page cache and removes it afterwards, whatever happens (SIGTERM
included; a probe of a killed process is removed by the next one). It refuses with the
numbers when the directory lacks the free space (keeping 1 GB spare).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from k3core.api.errors import UsageError
from k3core.api.partials import Partials, partial_path, sweep_stale
from k3core.api.units import human
from k3core.tools.bench.pagecache import drop_cached

SPARE_BYTES = 10**9
MIN_PROBE_BYTES = 10**6
WRITE_CHUNK = 64 << 20
#: the probe file's name (written as a partial: ``.k3-diskbench.partial-PID-TAG``)
PROBE_NAME = "k3-diskbench"


@contextmanager
def probe_file(target: Path, nbytes: int, seed: int = 0) -> Iterator[tuple[Path, list[str]]]:
    """Yield ``(file to read, notes)``; see the module docstring."""
    if target.is_file():
        yield target, [f"measured the existing file {target}"]
        return
    if not target.is_dir():
        raise UsageError(f"{target}: no such file or directory")
    if nbytes < MIN_PROBE_BYTES:
        raise UsageError(f"probe file size {nbytes} is below {human(MIN_PROBE_BYTES)}")
    free = shutil.disk_usage(target).free
    if free < nbytes + SPARE_BYTES:
        raise UsageError(
            f"{target}: the probe file needs {human(nbytes)} plus {human(SPARE_BYTES)} spare, "
            f"only {human(free)} free",
            hint="probe a smaller size or another directory",
        )
    sweep_stale(target, [PROBE_NAME])
    with Partials() as parts:  # removed whatever happens, SIGTERM included
        path = parts.add(partial_path(target / PROBE_NAME, secrets.token_hex(4)))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise UsageError(f"{target}: cannot write a probe file: {exc.strerror}") from exc
        try:
            seconds = _fill(fd, nbytes, seed)
            os.close(fd)
            fd = -1
            drop_cached(path)
            note = (
                f"wrote a {nbytes / 1e9:.2f} GB probe file at {nbytes / seconds / 1e6:,.0f} MB/s "
                f"(including fsync); removed afterwards"
            )
            yield path, [note]
        finally:
            if fd >= 0:
                os.close(fd)


def _fill(fd: int, nbytes: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    left = nbytes
    while left:
        block = rng.bytes(min(WRITE_CHUNK, left))
        view = memoryview(block)
        while view:
            view = view[os.write(fd, view) :]
        left -= len(block)
    os.fsync(fd)
    return time.perf_counter() - t0
