"""Fault injection for storage tests: the registered ``faulty`` backend, whose reads can
fail or wait (an object wrapped in-process to fail reads by number or byte range is
:class:`k3core.testing.faults.FaultInjector`).

:class:`FaultyStorage` delegates to a registered storage backend and, for files whose name
matches ``match``, can fail the ``n``-th and later reads (after scribbling over part of the
destination, so serving a failed buffer would show), fail reads at chosen offsets, or hold
a read until a test releases it. Every read is logged. The CLI tests reach it as the
``faulty`` storage backend (:func:`register_faulty`), configured by ``K3_FAULT_*``
environment variables: ``K3_FAULT_INNER`` (backend name, default ``plain``),
``K3_FAULT_MATCH`` (file name, default ``trunk.bin``), ``K3_FAULT_AFTER`` (reads that
succeed before every later one fails), ``K3_FAULT_OFFSETS`` (comma-separated file offsets
whose reads fail, e.g. one routed expert's start), ``K3_FAULT_RANGE`` (``LO:HI``: every
read of the file overlapping bytes ``[LO, HI)`` fails, e.g. one tensor's bytes) and
``K3_FAULT_HOLD`` (a path: the first read of the matching file at offset
``K3_FAULT_HOLD_OFFSET``, default any, creates it and then waits, up to two minutes, for
the test to stop the process, so a writer is caught mid-write at a known point; the read's
bytes are not changed).

:func:`disk_backed_dir` picks a directory for test data that O_DIRECT can use: the given
temporary directory unless it is on tmpfs (which refuses O_DIRECT), else a fresh directory
under the checkout's ``build/`` (git-ignored).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import StorageError
from k3core.api.hookspecs import hookimpl
from k3core.api.specs import StorageBackendSpec
from k3core.api.storage import StorageBackend, StorageFile
from k3core.plugins.registry import Registry, get_registry
from k3core.testing.disk import disk_scratch_root, is_memory_fs


class FaultyStorage(StorageBackend):
    """A wrapped backend whose reads of matching files fail or wait on demand."""

    name = "faulty"

    def __init__(self, inner: StorageBackend | None = None, match: str | None = None,
                 fail_after: int | None = None, fail_offsets: Iterable[int] = (),
                 fail_range: tuple[int, int] | None = None):
        super().__init__()
        if inner is None:
            inner, _, _ = get_registry().create("storage", os.environ.get("K3_FAULT_INNER", "plain"))
        self.inner = inner
        self.alignment = inner.alignment
        self.match = match if match is not None else os.environ.get("K3_FAULT_MATCH", "trunk.bin")
        env_after = os.environ.get("K3_FAULT_AFTER")
        self.fail_after = fail_after if fail_after is not None else (
            int(env_after) if env_after else None)
        env_offsets = os.environ.get("K3_FAULT_OFFSETS", "")
        self.fail_offsets = set(fail_offsets) | {int(o) for o in env_offsets.split(",") if o.strip()}
        env_range = os.environ.get("K3_FAULT_RANGE")
        if fail_range is None and env_range:
            lo, _, hi = env_range.partition(":")
            fail_range = (int(lo), int(hi))
        self.fail_range = fail_range
        self.hold = os.environ.get("K3_FAULT_HOLD") or None
        hold_at = os.environ.get("K3_FAULT_HOLD_OFFSET")
        self.hold_offset = int(hold_at) if hold_at else None
        self.gates: dict[int, threading.Event] = {}  # offset -> released when set
        self.log: list[tuple[str, int, int]] = []
        self.matched_reads = 0
        self.failures = 0
        self._lock = threading.Lock()

    def open(self, path: str | Path) -> StorageFile:
        return _FaultyFile(self, self.inner.open(path))


class _FaultyFile(StorageFile):
    def __init__(self, owner: FaultyStorage, inner: StorageFile):
        self.owner = owner
        self.inner = inner
        self.path = inner.path
        self.size = inner.size

    def read_into(self, offset: int, out: np.ndarray | memoryview) -> None:
        o = self.owner
        view = (out if isinstance(out, memoryview) else out.data).cast("B")
        matched = self.path.name == o.match
        with o._lock:
            o.log.append((self.path.name, offset, view.nbytes))
            n = o.matched_reads
            if matched:
                o.matched_reads += 1
        if matched and o.hold is not None and o.hold_offset in (None, offset):
            _hold(Path(o.hold))
        if matched:
            gate = o.gates.get(offset)
            if gate is not None:
                gate.wait(30)
            failing = ((o.fail_after is not None and n >= o.fail_after) or offset in o.fail_offsets
                       or (o.fail_range is not None and offset < o.fail_range[1]
                           and o.fail_range[0] < offset + max(view.nbytes, 1)))
            if failing:
                half = view.nbytes // 2
                try:  # a torn buffer: real bytes, then garbage
                    self.inner.read_into(offset, view[:half])
                except StorageError:
                    pass
                view[half:] = b"\xff" * (view.nbytes - half)
                with o._lock:
                    o.failures += 1
                raise StorageError(f"{self.path}: injected read failure at offset {offset} "
                                   f"({view.nbytes} bytes)")
        self.inner.read_into(offset, out)

    def close(self) -> None:
        self.inner.close()


def _hold(flag: Path, seconds: float = 120.0) -> None:
    """Say (by creating ``flag``) that a read is waiting, then wait in short sleeps, so the
    process's signal handlers run while it waits."""
    if flag.exists():
        return  # held once already
    flag.touch()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)


class _FaultyPlugin:
    @hookimpl
    def k3_storage_backends(self) -> list[StorageBackendSpec]:
        return [StorageBackendSpec(name="faulty", factory="k3core.testing.faulty_backend:FaultyStorage",
                                   description="test-only fault injection around a real backend",
                                   priority=-100)]


def register_faulty(reg: Registry | None = None) -> None:
    """Make ``--storage faulty`` resolvable in this process (tests only)."""
    reg = reg or get_registry()
    if "faulty" not in reg.names("storage"):
        reg.add_plugin(_FaultyPlugin(), "k3 tests (k3core.testing.faulty_backend)", "faulty")


def unregister_faulty(reg: Registry | None = None) -> None:
    """Undo :func:`register_faulty` (keeps the process-wide registry as other tests expect)."""
    reg = reg or get_registry()
    reg.entries.get("storage", {}).pop("faulty", None)
    reg._probes.pop(("storage", "faulty"), None)


def available_storage() -> list[str]:
    """Registered storage backends that can run here (the tests parametrise over these)."""
    reg = get_registry()
    return [n for n in reg.names("storage") if n != "faulty" and reg.probe("storage", n).ok]


def disk_backed_dir(candidate: Path) -> Path:
    """``candidate`` unless it is on a memory filesystem (which refuses O_DIRECT); else a fresh
    directory under :func:`k3core.testing.disk.disk_scratch_root`."""
    if not is_memory_fs(candidate):
        return candidate
    return Path(tempfile.mkdtemp(prefix="k3-test-", dir=disk_scratch_root()))


def env(**kw: Any) -> dict[str, str]:
    """``K3_FAULT_*`` variables for the ``faulty`` backend, as strings."""
    return {f"K3_FAULT_{k.upper()}": str(v) for k, v in kw.items()}
