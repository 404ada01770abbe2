"""The storage-backend conformance suite, shipped for built-in and third-party backends.

A backend's whole test file is one subclass, either through the registry (which tests the
registration too) or with a fixture that builds the backend::

    from k3.testing import StorageConformance

    class TestMyStorage(StorageConformance):
        storage_name = "mine"            # or:

        @pytest.fixture
        def storage_backend(self):
            return MyStorage()

It checks the contract written on :class:`k3.plugin.StorageBackend`, comparing every read
with plain Python reads of the same file, and catches what breaks a backend:

* **wrong bytes** for any range: aligned, unaligned, 1-byte, zero-length, whole-file,
  end-of-file and block-straddling ranges of a 321 KiB random file into aligned, unaligned
  and offset-congruent numpy arrays and memoryviews; and reads of 1 to 24 MiB at unaligned
  offsets of a 24 MiB file whose bytes encode their own offset (across 1 MiB, 16 MiB and any
  other internal chunking; a backend that loses offset bits on large reads fails here);
  with ``-m slow``, one read of more than a GiB from a sparse file;
* **a shared file position**: 16 threads lined up at a barrier, round after round, reading
  overlapping ranges of one open file, every read's bytes compared (a seek then a read
  without a lock fails here every time); every thread's exception fails the test;
* **stale bytes**: a file replaced at the same path (renamed over, rewritten in place with
  the same size and times, replaced by a shorter one) reads its new bytes on the next open;
* **leaked handles**: hundreds of open/close cycles and failed opens leave this process's
  descriptor (or handle) count where it was;
* **resident memory**: reading six times :attr:`StorageConformance.resident_allowance`
  through one open file grows this process's resident set by less than that allowance;
* **refusals**: reads outside the file, of a file truncated after open, after ``close``,
  into a read-only or non-contiguous buffer; opening a missing file or a directory: each a
  ``StorageError`` (not another exception, not a short read);
* **stats**: one call and its bytes for every read that returns, nothing for one that fails.

Every failure names the operation, the file, the offset, the length and the first differing
byte. The data is written on a real disk (:mod:`k3core.testing.disk`: ``$K3_TEST_DISK_DIR``
when set, else the system temp directory unless it is tmpfs), and the run says where once.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from k3core.api.errors import StorageError
from k3core.api.storage import Buffer, StorageBackend, aligned_empty
from k3core.api.units import ALIGN
from k3core.testing.disk import describe_scratch_root, disk_tmpdir
from k3core.testing.process import MemoryWatch, open_handles
from k3core.testing.storage_data import (
    describe_difference,
    pattern_bytes,
    python_read,
    write_pattern_file,
    write_random_file,
    write_sparse_pattern_file,
)
from k3core.testing.threads import run_threads, thread_errors_fail

__all__ = ["BIG_READS", "BIG_SIZE", "RANGES", "SIZE", "StorageConformance", "python_read",
           "write_random_file"]

MiB = 1 << 20
#: the small test file's size: 5 x 64 KiB + 777, aligned to nothing
SIZE = 5 * 65536 + 777
_LAST_BLOCK = SIZE & ~4095
#: the large test file (pattern bytes): 24 MiB + 777
BIG_SIZE = 24 * MiB + 777
#: the huge sparse file of the slow test: past 1 GiB (a common per-call cap) and 16 x 64 MiB
HUGE_SIZE = (1 << 30) + 3 * MiB + 777

RANGES: dict[str, tuple[int, int]] = {
    "aligned": (4096, 8192),
    "aligned-large": (65536, 131072),
    "unaligned": (1234, 5000),
    "unaligned-large": (4095, 100003),
    "tiny-start": (0, 1),
    "tiny-mid": (SIZE // 2 + 3, 1),
    "tiny-last": (SIZE - 1, 1),
    "zero-start": (0, 0),
    "zero-mid": (777, 0),
    "zero-eof": (SIZE, 0),
    "whole-file": (0, SIZE),
    "eof-tail": (SIZE - 5000, 5000),
    "eof-last-block": (_LAST_BLOCK, SIZE - _LAST_BLOCK),
    "eof-straddle": (_LAST_BLOCK - 3, SIZE - _LAST_BLOCK + 3),
    "straddle-4k": (4000, 200),
    "straddle-64k": (65536 - 10, 20),
    "straddle-many": (4096 * 3 - 1, 4096 * 4 + 2),
}

#: reads of the large file: ``(offset, nbytes)``, every one past 1 MiB at an unaligned offset
BIG_READS: dict[str, tuple[int, int]] = {
    "1MiB+1": (4095, MiB + 1),
    "4MiB-unaligned": (MiB - 3, 4 * MiB + 4099),
    "across-16MiB": (16 * MiB - 5, 3 * MiB + 7),
    "whole-file-but-ends": (7, BIG_SIZE - 10),
}

BAD_RANGES: dict[str, tuple[int, int]] = {
    "negative-offset": (-1, 10),
    "past-eof": (SIZE - 5, 10),
    "start-after-eof": (SIZE + 1, 0),
    "far-past-eof": (SIZE + 100, 5),
}


def _numpy_aligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n, ALIGN)


def _numpy_unaligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n + 1, ALIGN)[1:]


def _numpy_congruent(n: int, offset: int) -> Buffer:
    """Address congruent to the file offset modulo ALIGN (body readable in place)."""
    k = offset % ALIGN
    return aligned_empty(n + k, ALIGN)[k:]


def _memoryview_bytearray(n: int, offset: int) -> Buffer:
    return memoryview(bytearray(n))


def _memoryview_aligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n, ALIGN).data


def _memoryview_unaligned(n: int, offset: int) -> Buffer:
    return aligned_empty(n + 3, ALIGN)[3:].data


DESTINATIONS: dict[str, Callable[[int, int], Buffer]] = {
    "numpy-aligned": _numpy_aligned,
    "numpy-unaligned": _numpy_unaligned,
    "numpy-congruent": _numpy_congruent,
    "memoryview-bytearray": _memoryview_bytearray,
    "memoryview-aligned": _memoryview_aligned,
    "memoryview-unaligned": _memoryview_unaligned,
}


def as_bytes(out: Buffer) -> np.ndarray:
    """A destination's bytes as a ``uint8`` array (no copy)."""
    return np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) \
        else out.reshape(-1).view(np.uint8)


def read_op(path: Path, offset: int, n: int, into: str = "") -> str:
    """How a failure names a read: ``read_into(offset=O, N bytes) of NAME [into KIND]``."""
    return f"read_into(offset={offset}, {n} bytes) of {path.name}" + (f" into {into}" if into else "")


def check_read(got: Buffer, want: bytes | np.ndarray, op: str, offset: int, *,
               whole: bytes | None = None, old: bytes | None = None) -> None:
    """Fail with :func:`describe_difference`'s sentence unless ``got`` holds ``want``."""
    __tracebackhide__ = True  # the test's own line is the story; the bytes are not printed
    w = np.frombuffer(want, dtype=np.uint8) if isinstance(want, bytes) else want
    problem = describe_difference(op, offset, as_bytes(got), w, whole=whole, old=old)
    if problem:
        raise AssertionError(problem)


def refused(what: str, consequence: str, fn: Callable[[], object]) -> StorageError:
    """Call ``fn``; return its ``StorageError``, or fail saying it returned or raised another."""
    __tracebackhide__ = True
    try:
        fn()
    except StorageError as exc:
        return exc
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc} instead of "
                             f"StorageError ({consequence})") from exc
    raise AssertionError(f"{what} returned instead of raising StorageError ({consequence})")


def registered_backend(name: str) -> StorageBackend:
    """The registered storage backend ``name``, built through the registry as ``--storage
    NAME`` builds it; skipped (with the probe's reason) where it cannot run here."""
    from k3core.plugins.registry import get_registry

    reg = get_registry()
    if name not in reg.names("storage"):
        pytest.fail(f"storage backend {name!r} is not registered (registered: "
                    f"{', '.join(reg.names('storage'))}): is the plugin installed, and is its "
                    "module in the `k3` entry-point group?")
    avail = reg.probe("storage", name)
    if not avail.ok:
        pytest.skip(f"storage backend {name!r} cannot run here: {avail.reason}")
    backend, _, _ = reg.create("storage", name)
    return backend


def _slow_mark() -> pytest.MarkDecorator:
    """``pytest.mark.slow``, without a warning in a project that does not register ``slow``
    (and an inert mark where ``--strict-markers`` would refuse it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        try:
            return pytest.mark.slow
        except pytest.fail.Exception:
            return pytest.mark.skipif(False, reason="")


_ANNOUNCED = pytest.StashKey[bool]()


def _announce_data_dir(config: pytest.Config) -> None:
    """Say once per session where the storage tests write (``-s`` not needed)."""
    if config.stash.get(_ANNOUNCED, False):
        return
    config.stash[_ANNOUNCED] = True
    line = f"k3 storage suite: test data under {describe_scratch_root()}"
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:  # pragma: no cover - pytest without its terminal (-p no:terminal)
        print(line, file=sys.stderr)
    elif capture is None:  # pragma: no cover - -p no:capture
        reporter.write_line(line)
    else:
        with capture.global_and_fixture_disabled():  # past the test's captured output
            reporter.write_line(line)


class StorageConformance:
    """Set ``storage_name = "registered-name"``, or provide the ``storage_backend`` fixture
    (a fresh backend instance per test)."""

    #: the registered name to test (``--storage NAME``); ``None``: the fixture builds it
    storage_name: str | None = None
    #: how much this process's resident set may grow while one file is read six times this
    #: many bytes (scratch such as a bounce buffer per thread fits in it; a read cache doesn't)
    resident_allowance: int = 8 * MiB
    #: threads reading one open file at once in the concurrency test
    threads: int = 16
    #: the large reads, ``name: (offset, nbytes)`` inside the :data:`BIG_SIZE`-byte file; a
    #: subclass may add its own (``{**BIG_READS, "my-chunk": (...)}``), say across its chunk size
    big_reads: dict[str, tuple[int, int]] = BIG_READS

    # ---- fixtures ---------------------------------------------------------------------
    @pytest.fixture
    def storage_backend(self) -> StorageBackend:
        if self.storage_name is None:
            pytest.fail(f"{type(self).__name__}: a StorageConformance subclass sets "
                        "storage_name = '...' or provides a storage_backend fixture")
        return registered_backend(self.storage_name)

    @pytest.fixture(autouse=True)
    def _thread_errors_fail(self) -> Iterator[None]:
        with thread_errors_fail():
            yield

    @pytest.fixture
    def data_dir(self, request: pytest.FixtureRequest) -> Iterator[Path]:
        _announce_data_dir(request.config)
        with disk_tmpdir("k3-storage-") as d:
            yield d

    @pytest.fixture
    def data_file(self, data_dir: Path) -> Path:
        path = data_dir / "data.bin"
        write_random_file(path, SIZE)
        return path

    @pytest.fixture(scope="class")
    @classmethod
    def big_file(cls, request: pytest.FixtureRequest) -> Iterator[Path]:
        _announce_data_dir(request.config)
        with disk_tmpdir("k3-storage-big-") as d:
            path = d / "big.bin"
            write_pattern_file(path, BIG_SIZE)
            yield path

    # ---- correct bytes ----------------------------------------------------------------
    @pytest.mark.parametrize("dest", list(DESTINATIONS))
    @pytest.mark.parametrize("rng", list(RANGES))
    def test_range_matches_python(
        self, storage_backend: StorageBackend, data_file: Path, rng: str, dest: str
    ) -> None:
        offset, n = RANGES[rng]
        out = DESTINATIONS[dest](n, offset)
        with storage_backend.open(data_file) as f:
            assert f.size == SIZE, f"open({data_file.name}).size is {f.size}, the file has {SIZE}"
            f.read_into(offset, out)
        whole = data_file.read_bytes()
        check_read(out, whole[offset : offset + n], read_op(data_file, offset, n, dest), offset,
                   whole=whole)

    def test_numpy_of_other_dtype(self, storage_backend: StorageBackend, data_file: Path) -> None:
        out = np.empty(1000, dtype=np.float32)
        with storage_backend.open(data_file) as f:
            f.read_into(8192, out)
        check_read(out, python_read(data_file, 8192, 4000),
                   read_op(data_file, 8192, 4000, "a float32 array"), 8192)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """``test_big_reads`` over this class's :attr:`big_reads` (a subclass may add some)."""
        if metafunc.definition.originalname == "test_big_reads":
            metafunc.parametrize("big", list(self.big_reads))

    @pytest.mark.parametrize("dest", ["numpy-unaligned", "numpy-congruent"])
    def test_big_reads(self, storage_backend: StorageBackend, big_file: Path, big: str,
                       dest: str) -> None:
        """Reads of 1 to 24 MiB at unaligned offsets, in one call each."""
        offset, n = self.big_reads[big]
        assert 0 <= offset and offset + n <= BIG_SIZE, (
            f"big_reads[{big!r}] = {(offset, n)} is outside the {BIG_SIZE}-byte file")
        out = DESTINATIONS[dest](n, offset)
        with storage_backend.open(big_file) as f:
            assert f.size == BIG_SIZE, f"open({big_file.name}).size is {f.size}, not {BIG_SIZE}"
            f.read_into(offset, out)
        want = pattern_bytes(offset, n)
        op = read_op(big_file, offset, n, dest)
        if describe_difference(op, offset, as_bytes(out), want) is not None:
            check_read(out, want, op, offset, whole=big_file.read_bytes())

    @_slow_mark()
    def test_huge_sparse_read(self, storage_backend: StorageBackend, data_dir: Path,
                              request: pytest.FixtureRequest) -> None:
        """One read of more than a GiB (a sparse file: holes, and the pattern in islands at
        every 64 MiB boundary, 1 GiB and the end). Runs only when ``-m slow`` selects it."""
        expr = request.config.getoption("markexpr", "") or ""
        if "slow" not in expr or "not slow" in expr:
            pytest.skip("a read of more than a GiB: run with -m slow")
        islands = [(0, 65536)] + [(k * 64 * MiB - 32768, 65536) for k in range(1, 17)]
        islands.append((HUGE_SIZE - 65536, 65536))
        path = data_dir / "huge.bin"
        write_sparse_pattern_file(path, HUGE_SIZE, islands)
        offset, n = 4093, HUGE_SIZE - 4093 - 11
        out = aligned_empty(n + 1, ALIGN)[1:]
        with storage_backend.open(path) as f:
            f.read_into(offset, out)
        op = read_op(path, offset, n, "numpy-unaligned")
        pos = offset
        for lo, size in sorted(islands) + [(offset + n, 0)]:
            lo, hi = max(lo, offset), min(lo + size, offset + n)
            gap = out[pos - offset : max(pos, lo) - offset]
            if gap.size and np.any(gap):
                check_read(gap, np.zeros(gap.size, np.uint8), f"{op} (a hole)", pos)
            if hi > lo:
                check_read(out[lo - offset : hi - offset], pattern_bytes(lo, hi - lo),
                           f"{op} (the data at {lo})", lo)
            pos = max(pos, hi)

    # ---- threads ------------------------------------------------------------------------
    def test_concurrent_reads(self, storage_backend: StorageBackend, data_file: Path) -> None:
        """Many threads, lined up at a barrier each round, reading overlapping ranges of one
        open file: a backend that shares a file position between reads fails every time."""
        whole = data_file.read_bytes()
        truth = np.frombuffer(whole, np.uint8)
        rounds, per_round = 12, 16
        makers = list(DESTINATIONS.items())
        plans: list[list[tuple[int, int, str]]] = []
        for t in range(self.threads):
            rng = np.random.default_rng(1000 + t)
            plan: list[tuple[int, int, str]] = []
            for _ in range(rounds * per_round):
                n = int(rng.integers(1, 16384))
                plan.append((int(rng.integers(0, SIZE - n + 1)), n, makers[len(plan) % len(makers)][0]))
            plans.append(plan)
        wrong: list[str] = []
        b0, _, c0 = storage_backend.stats.snapshot()
        with storage_backend.open(data_file) as f:

            def reader(t: int, barrier: threading.Barrier) -> None:
                for r in range(rounds):
                    todo = plans[t][r * per_round : (r + 1) * per_round]
                    outs = [DESTINATIONS[dest](n, offset) for offset, n, dest in todo]
                    barrier.wait(60)
                    k = 0
                    try:  # back to back, nothing between the reads: they overlap the most
                        for k in range(per_round):
                            f.read_into(todo[k][0], outs[k])
                    except Exception as exc:
                        offset, n, dest = todo[k]
                        raise AssertionError(f"{read_op(data_file, offset, n, dest)} (thread {t}, "
                                             f"round {r}) raised {type(exc).__name__}: {exc}") from exc
                    for (offset, n, dest), out in zip(todo, outs, strict=True):
                        problem = describe_difference(
                            f"{read_op(data_file, offset, n, dest)} (thread {t}, round {r})", offset,
                            as_bytes(out), truth[offset : offset + n], whole=whole)
                        if problem:
                            wrong.append(problem)

            what = (f"{self.threads} threads reading one open file at once (a backend whose "
                    "reads share a file position, a seek then a read without a lock, fails so)")
            run_threads(reader, self.threads, what=what)
        total = self.threads * rounds * per_round
        if wrong:
            raise AssertionError(f"{what}: {len(wrong)} of {total} reads returned wrong bytes; "
                                 f"first: {wrong[0]}")
        b1, _, c1 = storage_backend.stats.snapshot()
        nbytes = sum(n for plan in plans for _, n, _ in plan)
        assert (c1 - c0, b1 - b0) == (total, nbytes), (
            f"stats after {total} concurrent reads of {nbytes} bytes count {c1 - c0} calls and "
            f"{b1 - b0} bytes (IOStats.add is thread-safe; is every read counted once?)")

    def test_read_many(self, storage_backend: StorageBackend, data_file: Path) -> None:
        whole = data_file.read_bytes()
        reqs = [(o, aligned_empty(n, ALIGN)) for o, n in [(70000, 9000), (0, 4096), (1, 50000)]]
        reqs.append((SIZE - 3, aligned_empty(10, ALIGN)))  # outside: only this one fails
        with storage_backend.open(data_file) as f:
            results = f.read_many(reqs, depth=4)
        got = ["ok" if r is None else type(r).__name__ for r in results]
        assert got == ["ok", "ok", "ok", "StorageError"], (
            f"read_many of three good reads and one past the end answered {got}")
        for o, out in reqs[:3]:
            check_read(out, whole[o : o + out.size], "read_many: " + read_op(data_file, o, out.size), o,
                       whole=whole)

    # ---- the file as it is now ------------------------------------------------------------
    def test_replaced_file_reads_new_bytes(self, storage_backend: StorageBackend,
                                           data_dir: Path) -> None:
        """A file replaced at the same path between opens: the next open reads the new bytes
        (renamed over; rewritten in place with the same size and times; a shorter one)."""
        path = data_dir / "replaced.bin"
        n = 3 * 65536 + 123

        def read_all(expect: bytes, old: bytes | None, how: str) -> None:
            with storage_backend.open(path) as f:
                assert f.size == len(expect), (
                    f"{how}: open({path.name}).size is {f.size}, the file now has {len(expect)} bytes")
                out = aligned_empty(len(expect), ALIGN)
                f.read_into(0, out)
            check_read(out, expect, f"{how}: {read_op(path, 0, len(expect))}", 0, old=old)

        first = write_random_file(path, n, seed=11)
        read_all(first, None, "the first open")
        second = np.random.default_rng(12).integers(0, 256, n, dtype=np.uint8).tobytes()
        tmp = data_dir / "replaced.bin.new"
        tmp.write_bytes(second)
        os.replace(tmp, path)
        read_all(second, first, "after the file was replaced by a rename")
        st = os.stat(path)
        third = np.random.default_rng(13).integers(0, 256, n, dtype=np.uint8).tobytes()
        with open(path, "r+b") as fh:
            fh.write(third)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        read_all(third, second, "after the file was rewritten in place (same size and times)")
        short = np.random.default_rng(14).integers(0, 256, n // 3, dtype=np.uint8).tobytes()
        tmp.write_bytes(short)
        os.replace(tmp, path)
        read_all(short, None, "after the file was replaced by a shorter one")

    # ---- what a backend holds -------------------------------------------------------------------
    def test_handles_released(self, storage_backend: StorageBackend, data_file: Path,
                              data_dir: Path) -> None:
        """Open/close cycles, with-blocks and failed opens leave the process's descriptor
        (Windows: handle) count where it was."""
        if open_handles() is None:
            pytest.skip("this platform does not report a process's open handles")
        out = aligned_empty(4096, ALIGN)
        for _ in range(3):  # warm up: whatever a backend opens once (and keeps) opens now
            with storage_backend.open(data_file) as f:
                f.read_into(0, out)
        for path in (data_dir / "missing.bin", data_dir):
            try:
                storage_backend.open(path).close()
            except StorageError:
                pass
        gc.collect()
        cycles = 64  # a leak of one descriptor a cycle shows as 64

        def plain_cycle() -> None:
            f = storage_backend.open(data_file)
            f.read_into(100, out)
            f.close()
            f.close()

        def with_block() -> None:
            with storage_backend.open(data_file) as f:
                f.read_into(SIZE - out.size, out)

        def failed_open() -> None:
            for path in (data_dir / "missing.bin", data_dir):
                try:
                    storage_backend.open(path).close()
                except StorageError:
                    pass

        for what, step in (("open, read_into, close", plain_cycle),
                           ("with open(...) as f: read_into", with_block),
                           ("open of a missing file and of a directory (refused)", failed_open)):
            before = open_handles() or 0
            for _ in range(cycles):
                step()
            gc.collect()
            after = open_handles() or 0
            assert after - before <= 2, (
                f"{cycles} x ({what}) left {after - before} more descriptors open in this "
                f"process ({before} -> {after}): close() or a failed open() does not release "
                "what open() took")

    def test_reads_keep_nothing_resident(self, storage_backend: StorageBackend,
                                         big_file: Path) -> None:
        """Read six times ``resident_allowance`` through one open file (1 MiB + 4099 bytes a
        read into one reused buffer): the resident set grows by less than the allowance."""
        chunk = MiB + 4099
        buf = aligned_empty(chunk + ALIGN, ALIGN)
        budget = self.resident_allowance
        goal = 6 * budget
        with storage_backend.open(big_file) as f:
            for off in (0, chunk):  # warm up: scratch a backend keeps and reuses is made now
                f.read_into(off, buf[off % ALIGN : off % ALIGN + chunk])
            rss, traced, done, off = 0, 0, 0, 0
            with MemoryWatch() as watch:
                while done < goal:
                    if off + chunk > BIG_SIZE:
                        off = (off + 4097) % 8192
                    k = off % ALIGN
                    dst = buf[k : k + chunk]
                    f.read_into(off, dst)
                    for at in (0, chunk - 64):  # a cheap check that each read read something
                        check_read(dst[at : at + 64], pattern_bytes(off + at, 64),
                                   read_op(big_file, off, chunk), off + at)
                    done += chunk
                    off += chunk
                    if done % (8 * chunk) < chunk or done >= goal:
                        r, p = watch.grown()
                        rss, traced = max(rss, r), max(traced, p)
        grown = max(rss, traced)
        assert grown < budget, (
            f"reading {done / 1e6:.1f} MB of {big_file.name} through one open file in "
            f"{chunk}-byte reads grew this process's resident memory by {grown / 1e6:.1f} MB "
            f"(resident set {rss / 1e6:+.1f} MB, Python objects {traced / 1e6:+.1f} MB; allowed "
            f"{budget / 1e6:.1f} MB): the backend keeps what it read resident (a read cache, "
            "or mappings left in place)")

    # ---- refusals ---------------------------------------------------------------------
    @pytest.mark.parametrize("bad", list(BAD_RANGES))
    def test_out_of_range_refused(
        self, storage_backend: StorageBackend, data_file: Path, bad: str
    ) -> None:
        offset, n = BAD_RANGES[bad]
        with storage_backend.open(data_file) as f:
            refused(f"{read_op(data_file, offset, n)} ({SIZE} bytes)",
                    "a range outside the file is refused, never read short or zero-filled",
                    lambda: f.read_into(offset, aligned_empty(n, ALIGN)))

    def test_truncated_after_open(self, storage_backend: StorageBackend, data_file: Path) -> None:
        keep = SIZE // 2
        expected = python_read(data_file, 0, 4096)
        with storage_backend.open(data_file) as f:
            try:
                os.truncate(data_file, keep)
            except OSError as exc:  # Windows refuses to truncate a mapped file: safe too
                pytest.skip(f"the OS refuses to truncate the open file: {exc}")
            for offset, n in [(keep + 100, 1000), (keep - 100, 200), (keep & ~4095, 8192)]:
                def gone(offset: int = offset, n: int = n) -> None:
                    f.read_into(offset, aligned_empty(n, ALIGN))

                refused(f"{read_op(data_file, offset, n)} after the file was truncated to "
                        f"{keep} bytes", "bytes that are gone cannot be read", gone)
            out = aligned_empty(4096, ALIGN)  # what is still there still reads correctly
            f.read_into(0, out)
            check_read(out, expected, read_op(data_file, 0, 4096) + " after truncation", 0)

    def test_missing_file_refused(self, storage_backend: StorageBackend, data_dir: Path) -> None:
        missing = data_dir / "no-such-file.bin"
        exc = refused(f"open({missing})", "a missing file is a StorageError naming it",
                      lambda: storage_backend.open(missing))
        assert missing.name in str(exc), f"open(missing file) raised {exc!r}, which does not name it"

    def test_directory_refused(self, storage_backend: StorageBackend, data_dir: Path) -> None:
        refused(f"open({data_dir}) of a directory", "only a regular file opens",
                lambda: storage_backend.open(data_dir))

    def test_read_after_close_refused(
        self, storage_backend: StorageBackend, data_file: Path
    ) -> None:
        f = storage_backend.open(data_file)
        f.close()
        f.close()  # idempotent
        refused(f"{read_op(data_file, 0, 16)} after close()", "a closed file reads nothing",
                lambda: f.read_into(0, aligned_empty(16, ALIGN)))

    @pytest.mark.parametrize("kind", ["read-only", "non-contiguous"])
    def test_bad_destination_refused(self, storage_backend: StorageBackend, data_file: Path,
                                     kind: str) -> None:
        out: Any
        if kind == "read-only":
            out = aligned_empty(100, ALIGN)
            out.setflags(write=False)
        else:
            out = aligned_empty(200, ALIGN)[::2]
        with storage_backend.open(data_file) as f:
            refused(f"{read_op(data_file, 0, 100, f'a {kind} array')}",
                    "only a writable contiguous buffer is filled", lambda: f.read_into(0, out))

    def test_empty_file(self, storage_backend: StorageBackend, data_dir: Path) -> None:
        path = data_dir / "empty.bin"
        path.write_bytes(b"")
        with storage_backend.open(path) as f:
            assert f.size == 0, f"open(an empty file).size is {f.size}"
            f.read_into(0, aligned_empty(0, ALIGN))
            refused(read_op(path, 0, 1) + " (an empty file)", "nothing is there to read",
                    lambda: f.read_into(0, aligned_empty(1, ALIGN)))

    # ---- stats ------------------------------------------------------------------------
    def test_stats_count_bytes_and_calls(
        self, storage_backend: StorageBackend, data_file: Path
    ) -> None:
        b0, _, c0 = storage_backend.stats.snapshot()
        sizes = [(0, 4096), (5, 10), (SIZE - 100, 100), (12345, 54321), (77, 0)]
        with storage_backend.open(data_file) as f:
            for offset, n in sizes:
                f.read_into(offset, aligned_empty(n, ALIGN))
            try:  # a refused read counts nothing
                f.read_into(SIZE - 5, aligned_empty(10, ALIGN))
            except StorageError:
                pass
        b1, seconds, c1 = storage_backend.stats.snapshot()
        want = (sum(n for _, n in sizes), len(sizes))
        assert (b1 - b0, c1 - c0) == want, (
            f"after {len(sizes)} reads of {want[0]} bytes (one of 0 bytes) and one refused, stats "
            f"count {b1 - b0} bytes in {c1 - c0} calls (one call a read that returned, its "
            "bytes; nothing for a refused one: wrap each read in backend.timed())")
        assert seconds >= 0.0, f"stats.seconds is {seconds}"
