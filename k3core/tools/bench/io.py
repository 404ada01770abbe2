"""The engine-shaped disk bandwidth probe behind ``k3 doctor`` and ``k3 bench io``.

``dd`` measures one sequential stream at queue depth 1 and misleads (badly on network
storage). The engine reads whole experts (17,547,264 bytes on the real checkpoint) at
random offsets, several at once, so this probe does the same (docs/engine-behaviours.md §7):

* random, aligned, non-overlapping reads of ``read_size`` bytes (default the expert size,
  and 4 MiB), ``reads`` of them per measurement (default 40, the reference ``devbw.py``);
* at queue depths 1, 4 and 16: ``depth`` threads each doing blocking ``os.preadv`` into
  their own aligned buffer (the call releases the GIL), timed from a common start to the
  last completion;
* raw ``O_DIRECT`` vs raw buffered reads. Buffered figures are only honest if the page
  cache state is known: before each buffered measurement the file's pages are dropped
  (``posix_fadvise DONTNEED``) and the row says what was cached before and after.

:func:`read_bandwidth` measures a named storage backend (``direct``, ``mmap``, ...) the same
way, so ``k3 bench io`` can put a backend next to the raw probe. :func:`probe_disk` does
the whole table; given a directory it writes a probe file there under a temporary name
and removes it afterwards. Results come back as :class:`DiskBenchResult` (``.rows()`` for
a table). No command-line code lives here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from k3core.api.errors import StorageError, UsageError
from k3core.api.read_priority import AHEAD_PIECE_BYTES
from k3core.api.storage import StorageBackend, aligned_empty
from k3core.api.units import ALIGN, align_up, human
from k3core.model.sizes import EXPERT_BYTES
from k3core.tools.bench.pagecache import cached_fraction, describe_cache, drop_cached

DEFAULT_READ_SIZES = (EXPERT_BYTES, 4 << 20)
DEFAULT_DEPTHS = (1, 4, 16)
DEFAULT_PROBE_BYTES = 1 << 30
DEFAULT_READS = 40
RAW_DIRECT = "raw O_DIRECT"
RAW_BUFFERED = "raw buffered"

ReadFn = Callable[[int, np.ndarray], None]


@dataclass(frozen=True)
class BandwidthSample:
    """One measurement: ``reads`` reads of ``read_size`` bytes at queue depth ``depth``."""

    method: str
    read_size: int
    depth: int
    reads: int
    nbytes: int
    seconds: float
    cache: str = ""  # what the page cache held, for methods that use it

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass
class DiskBenchResult:
    """All samples of one probe run, plus notes (probe file, refusals, cache caveats)."""

    path: Path
    file_size: int
    samples: list[BandwidthSample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    HEADER = ("method", "read size", "QD", "reads", "MB", "seconds", "MB/s", "page cache")

    def rows(self) -> list[tuple[str, ...]]:
        """One tuple of strings per sample, in :attr:`HEADER` order."""
        return [
            (
                s.method,
                human(s.read_size),
                str(s.depth),
                str(s.reads),
                f"{s.nbytes / 1e6:,.0f}",
                f"{s.seconds:.3f}",
                f"{s.mb_per_s:,.0f}",
                s.cache,
            )
            for s in self.samples
        ]

    def mb_per_s(self, method: str, read_size: int, depth: int) -> float | None:
        for s in self.samples:
            if (s.method, s.read_size, s.depth) == (method, read_size, depth):
                return s.mb_per_s
        return None


# ---- the measurement loop -------------------------------------------------------------
def read_offsets(file_size: int, read_size: int, count: int, seed: int = 0) -> list[int]:
    """``count`` random aligned offsets of non-overlapping ``read_size`` reads in the file.

    The file is cut into aligned slots; slots are taken in random order without repeats
    until all are used, then reshuffled (so repeats only happen when ``count`` exceeds the
    number of slots).
    """
    stride = align_up(read_size)
    if read_size <= 0 or read_size > file_size:
        raise UsageError(f"read size {read_size} does not fit a {file_size}-byte file")
    nslots = (file_size - read_size) // stride + 1
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < count:
        out.extend(int(s) * stride for s in rng.permutation(nslots))
    return out[:count]


def measure(
    read: ReadFn, offsets: Sequence[int], read_size: int, depth: int, seconds: float | None = None
) -> tuple[int, int, float]:
    """Run the reads on ``depth`` threads; return ``(reads done, bytes, seconds)``.

    With ``seconds``, threads stop taking new reads once that much time has passed
    (cycling through ``offsets``); otherwise every offset is read once.
    """
    if depth < 1:
        raise UsageError(f"queue depth must be >= 1, got {depth}")
    lock = threading.Lock()
    state = {"next": 0, "done": 0}
    errors: list[BaseException] = []
    start = threading.Barrier(depth + 1)
    deadline = [0.0]

    def take() -> int | None:
        with lock:
            i = state["next"]
            if seconds is None and i >= len(offsets):
                return None
            if seconds is not None and time.perf_counter() >= deadline[0]:
                return None
            state["next"] = i + 1
            return offsets[i % len(offsets)]

    buffers = [aligned_empty(read_size, ALIGN) for _ in range(depth)]  # before any thread waits

    def worker(buf: np.ndarray) -> None:
        start.wait()
        try:
            while (off := take()) is not None:
                read(off, buf)
                with lock:
                    state["done"] += 1
        except BaseException as exc:  # reported below, after the other threads end
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(b,), daemon=True) for b in buffers]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    deadline[0] = t0 + (seconds or 0.0)
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        err = errors[0]
        raise err if isinstance(err, StorageError) else StorageError(f"probe read failed: {err}")
    return state["done"], state["done"] * read_size, elapsed


def _pread_full(fd: int, path: Path) -> ReadFn:
    def read(offset: int, buf: np.ndarray) -> None:
        got = 0
        while got < buf.size:
            r = os.preadv(fd, [buf[got:].data], offset + got)
            if r == 0:
                raise StorageError(f"{path}: short read at offset {offset + got}")
            got += r

    return read


def _cache_note(path: Path) -> str:
    before = cached_fraction(path)
    dropped = drop_cached(path)
    return describe_cache(before, cached_fraction(path) if dropped else None, dropped)


# ---- public entry points --------------------------------------------------------------
def raw_bandwidth(
    path: str | Path,
    read_size: int = EXPERT_BYTES,
    depth: int = 1,
    *,
    direct: bool = True,
    reads: int = DEFAULT_READS,
    seed: int = 0,
) -> BandwidthSample:
    """The raw probe: ``O_DIRECT`` (``direct=True``) or buffered preads, no backend."""
    p = Path(path)
    size = _file_size(p)
    if direct and read_size % ALIGN:
        raise UsageError(f"O_DIRECT probe reads must be a multiple of {ALIGN}, got {read_size}")
    flags = os.O_RDONLY
    if direct:
        if not hasattr(os, "O_DIRECT"):
            raise StorageError("O_DIRECT is not available on this OS")
        flags |= os.O_DIRECT
    note = "bypassed" if direct else _cache_note(p)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        raise StorageError(f"{p}: cannot open{' O_DIRECT' if direct else ''}: {exc.strerror}") from exc
    try:
        offsets = read_offsets(size, read_size, reads, seed)
        done, nbytes, secs = measure(_pread_full(fd, p), offsets, read_size, depth)
    except OSError as exc:
        raise StorageError(f"{p}: probe read failed: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    return BandwidthSample(
        RAW_DIRECT if direct else RAW_BUFFERED, read_size, depth, done, nbytes, secs, note
    )


def read_bandwidth(
    backend: StorageBackend | str,
    path: str | Path,
    read_size: int = EXPERT_BYTES,
    depth: int = 1,
    *,
    reads: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
) -> BandwidthSample:
    """Measure a storage backend (an instance, or a registered name) like the raw probe.

    ``reads`` reads (default 40), or as many as fit in ``seconds``. The file's page cache
    is dropped first and the sample says what was cached.
    """
    if isinstance(backend, str):
        from k3core.plugins.registry import get_registry

        backend = get_registry().create("storage", backend)[0]
    assert isinstance(backend, StorageBackend)
    p = Path(path)
    size = _file_size(p)
    note = _cache_note(p)
    count = reads if reads is not None else (DEFAULT_READS if seconds is None else 1 << 16)
    offsets = read_offsets(size, read_size, count, seed)
    with backend.open(p) as f:
        done, nbytes, secs = measure(f.read_into, offsets, read_size, depth, seconds)
    if done > len(set(offsets)):
        note += f"; ranges repeat ({len(set(offsets))} distinct)"
    return BandwidthSample(f"storage {backend.name}", read_size, depth, done, nbytes, secs, note)


def storage_read_rate(backend: str, path: Path, depths: Sequence[int],
                      read_size: int = AHEAD_PIECE_BYTES,
                      most_reads: int = 64) -> tuple[float, str]:
    """The best read rate (GB/s) of storage ``backend`` on ``path`` over queue ``depths``, and
    how it was measured: the disk floor beside a run that reads that file as it decodes.

    Reads of ``read_size`` (the trunk reader's 8 MiB pieces) at random aligned offsets, each
    range once (at most ``most_reads``, so a buffered backend is not timed on its own cache),
    the file's page cache dropped first (:func:`read_bandwidth`). The best depth is reported:
    the engine's trunk reader and its expert readers read at once, and no decode that reads
    the same bytes from this device can beat its best rate.
    """
    size = _file_size(path)
    reads = max(1, min(most_reads, size // read_size))
    size_used = min(read_size, size)
    qd = sorted({max(1, d) for d in depths})
    best: BandwidthSample | None = None
    for depth in qd:
        got = read_bandwidth(backend, path, size_used, depth, reads=reads)
        if best is None or got.mb_per_s > best.mb_per_s:
            best = got
    assert best is not None
    how = (f"storage '{backend}', {best.reads} reads of {human(best.read_size)} at queue depth "
           f"{best.depth} (best of {', '.join(map(str, qd))}) "
           f"from {path.name}")
    return best.mb_per_s / 1e3, how


def probe_disk(
    target: str | Path,
    *,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    read_sizes: Iterable[int] = DEFAULT_READ_SIZES,
    depths: Iterable[int] = DEFAULT_DEPTHS,
    reads: int = DEFAULT_READS,
    raw: Iterable[str] = ("direct", "buffered"),
    backends: Iterable[StorageBackend | str] = (),
    seed: int = 0,
) -> DiskBenchResult:
    """The whole probe table for a file, or for a directory (a probe file is written there).

    ``raw`` picks the raw methods (``"direct"``, ``"buffered"``); ``backends`` adds
    storage backends measured through :func:`read_bandwidth`. A raw ``O_DIRECT`` refusal
    becomes a note, not an error.
    """
    from k3core.tools.bench.probefile import probe_file

    read_sizes, depths, raw = list(read_sizes), list(depths), list(raw)
    with probe_file(Path(target), probe_bytes, seed) as (path, notes):
        result = DiskBenchResult(path, _file_size(path), notes=list(notes))
        if raw and not hasattr(os, "preadv"):
            result.notes.append("raw probe skipped: it needs POSIX preadv; backends only")
            raw = []
        for read_size in read_sizes:
            for method in raw:
                try:
                    for depth in depths:
                        result.samples.append(
                            raw_bandwidth(path, read_size, depth, direct=method == "direct",
                                          reads=reads, seed=seed)  # fmt: skip
                        )
                except StorageError as exc:
                    if method != "direct":
                        raise
                    result.notes.append(f"raw O_DIRECT skipped: {exc.message}")
            for b in backends:
                for depth in depths:
                    result.samples.append(
                        read_bandwidth(b, path, read_size, depth, reads=reads, seed=seed)
                    )
        return result


def _file_size(path: Path) -> int:
    try:
        if not path.is_file():
            raise UsageError(f"{path}: not a file")
        return path.stat().st_size
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from exc
