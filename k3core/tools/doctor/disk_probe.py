"""Disk read bandwidth for ``k3 doctor``, measured the way the engine reads.

The interface ``k3 doctor`` codes against is one callable::

    measure(path: Path) -> list[tuple[str, int, float]]   # (mode, queue depth, MB/s)

:func:`default_measure` gives :func:`diskbench_measure`: random reads of one expert's size
(:data:`k3core.model.sizes.EXPERT_BYTES`) through :func:`k3core.tools.bench.io.raw_bandwidth`,
O_DIRECT and buffered (page cache dropped), at queue depths 1, 4 and 16.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from k3core.api.partials import Partials, partial_path, sweep_stale
from k3core.api.units import ALIGN
from k3core.model.sizes import EXPERT_BYTES

DiskResult = tuple[str, int, float]
DiskMeasure = Callable[[Path], list[DiskResult]]
#: ``(done, total)``: read tests finished, or scratch bytes written
Steps = Callable[[int, int], None]

DEFAULT_PROBE_BYTES = 256 << 20


def default_measure(max_bytes: int = DEFAULT_PROBE_BYTES,
                    on_test: Steps | None = None) -> tuple[DiskMeasure, str]:
    """``(measure, description)``: the diskbench probe (O_DIRECT and buffered, QD 1/4/16);
    ``on_test(done, total)`` after each read test."""
    return (lambda p: diskbench_measure(p, max_bytes=max_bytes, on_test=on_test),
            "random expert-sized reads, O_DIRECT vs buffered (page cache dropped), QD 1/4/16")


def diskbench_measure(path: str | Path, *, max_bytes: int = DEFAULT_PROBE_BYTES,
                      on_test: Steps | None = None) -> list[DiskResult]:
    """Rows ``(mode, depth, MB/s)`` from :func:`k3core.tools.bench.io.raw_bandwidth`."""
    from k3core.api.errors import StorageError
    from k3core.tools.bench.io import raw_bandwidth

    size = Path(path).stat().st_size
    read_size = max(ALIGN, min(EXPERT_BYTES, size // 4) // ALIGN * ALIGN)  # an expert-sized read
    if size < read_size:
        return []
    reads = max(1, min(40, max_bytes // read_size))
    out: list[DiskResult] = []
    depths = (1, 4, 16)
    if on_test is not None:
        on_test(0, 2 * len(depths))
    for mode, direct in (("O_DIRECT", True), ("buffered", False)):
        for k, depth in enumerate(depths):
            try:
                s = raw_bandwidth(path, read_size, depth, direct=direct, reads=reads)
            except StorageError:
                if direct:
                    break
                raise
            out.append((mode, depth, s.mb_per_s))
            if on_test is not None:
                left = len(depths) - 1 - k + (len(depths) if direct else 0)
                on_test(len(out), len(out) + left)
    return out


#: the doctor's scratch file, written as a partial (``.k3-doctor-probe.partial-PID``)
PROBE_NAME = "k3-doctor-probe"
_scratch = Partials()


def write_probe_file(folder: Path, nbytes: int, on_bytes: Steps | None = None) -> Path:
    """A scratch file of ``nbytes`` random bytes in ``folder``, flushed to the device;
    ``on_bytes(written, nbytes)`` after each chunk. It is a registered partial file
    (:mod:`k3core.api.partials`): removed if writing it fails, on SIGTERM, and by the next
    doctor if this process is killed; :func:`remove_probe_file` removes it after use."""
    sweep_stale(folder, [PROBE_NAME])
    path = _scratch.add(partial_path(folder / PROBE_NAME))
    chunk = os.urandom(min(nbytes, 8 << 20))
    try:
        with open(path, "wb") as fh:
            left = nbytes
            if on_bytes is not None:
                on_bytes(0, nbytes)
            while left > 0:
                fh.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
                if on_bytes is not None:
                    on_bytes(nbytes - max(0, left), nbytes)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        remove_probe_file(path)
        raise
    return path


def remove_probe_file(path: Path) -> None:
    """Remove the scratch file :func:`write_probe_file` made."""
    path.unlink(missing_ok=True)
    _scratch.keep(path)
