"""Where a run's outputs go, checked before the run and written so nothing is clobbered.

An output path is one of three kinds of :class:`OutputTarget`:

* a **stream**: ``-`` (standard output), anything that is not a regular file once symlinks
  are followed (a FIFO, a character device such as ``/dev/null``), or a name of a descriptor
  this process already has open (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
  ``/proc/self/fd/N``, directly or through symlinks: written to that descriptor, after what
  Python buffered for it). A stream is written in place (opened for appending, never
  created, truncated or renamed over);
* a **file**: a regular file, or a name that does not exist yet. It is written atomically:
  a temporary name in the same directory, fsync, rename. A symlink is written *through*: its
  target is replaced and the link is kept. A replaced file keeps its permission bits; a new
  one gets ``0666`` less the umask;
* a **directory** (``--dump-cache-trace DIR``): created (with its parents) if missing.

:func:`check_outputs` is the pre-flight the runner calls once, before anything large
happens. It refuses (``OutputError``, exit 3) a path whose directory is missing, read-only
or cannot hold a file at all (``/proc/x.json``: it creates and removes a probe file, which
also answers for root, whom permission bits do not stop), a target that is a directory,
an output inside MODEL_DIR (or another input directory), and two outputs at one path.
A file k3 writes is either complete or absent; a failure is an ``OutputError`` (exit 3).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import OutputError
from k3core.api.filemode import new_file_mode

STDOUT = "-"
#: paths that name a descriptor already open in this process (written in place, never renamed)
_DESCRIPTORS = {"/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR_PREFIXES = ("/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/")
#: the files ``--dump-cache-trace DIR`` writes (k3core.experts.trace)
TRACE_FILES = ("expert_trace.bin", "expert_hist.json")


@dataclass(frozen=True)
class OutputTarget:
    """One output: what the user typed, what it is, and the path bytes finally land at."""

    given: Path
    what: str  # the flag, for messages
    kind: str  # "stream", "file" or "dir"
    real: Path  # a file: the symlink-resolved path; a stream: the path to open; a dir: itself

    @property
    def is_stdout(self) -> bool:
        return str(self.given) == STDOUT

    def identity(self) -> tuple[object, ...]:
        """Equal for two targets that are the same place."""
        if self.is_stdout:
            return ("stdout",)
        try:
            st = os.stat(self.real)
            return ("inode", st.st_dev, st.st_ino)
        except OSError:
            return ("path", os.path.normcase(os.path.abspath(self.real)))


def target(path: str | Path, what: str, *, directory: bool = False) -> OutputTarget:
    """Classify ``path`` (no file is created or changed)."""
    p = Path(path)
    if str(path) == STDOUT and not directory:
        return OutputTarget(p, what, "stream", p)
    if directory:
        if p.exists() and not p.is_dir():
            raise OutputError(f"cannot write {what} {p}: it exists and is not a directory")
        return OutputTarget(p, what, "dir", p)
    if _names_descriptor(p):
        return OutputTarget(p, what, "stream", p)
    try:
        st = os.stat(p)  # follows symlinks
    except FileNotFoundError:
        return OutputTarget(p, what, "file", Path(os.path.realpath(p)))
    except OSError as exc:
        raise OutputError(f"cannot write {what} {p}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write {what} {p}: it is a directory")
    if stat.S_ISREG(st.st_mode):
        return OutputTarget(p, what, "file", Path(os.path.realpath(p)))
    return OutputTarget(p, what, "stream", p)


def _names_descriptor(p: Path) -> bool:
    return descriptor_number(p) is not None


def descriptor_number(p: Path) -> int | None:
    """The open descriptor ``p`` names (``/dev/stdout`` is 1), following its symlinks."""
    text = os.path.abspath(p)
    prefixes = (*_DESCRIPTOR_PREFIXES, f"/proc/{os.getpid()}/fd/")
    for _ in range(40):
        if text in _DESCRIPTORS:
            return _DESCRIPTORS[text]
        for pre in prefixes:
            if text.startswith(pre) and text[len(pre):].isdigit():
                return int(text[len(pre):])
        try:
            link = os.readlink(text)
        except OSError:
            return None
        text = os.path.normpath(os.path.join(os.path.dirname(text), link))
    return None


# ---- pre-flight -------------------------------------------------------------------------------
def check_outputs(
    out: Path | None = None,
    dump_logits: Path | None = None,
    trace_dir: Path | None = None,
    *,
    inputs: Iterable[Path | None] = (),
    extra: Iterable[tuple[Path | None, str]] = (),
) -> list[OutputTarget]:
    """Refuse, before the run, every output that could not be written or would clobber.

    ``inputs`` are directories the run reads (MODEL_DIR, the packed trunk): no output may
    land inside one. ``trace_dir`` is created here if it does not exist. ``extra`` holds more
    ``(path, flag)`` file outputs (``--save-state``).
    """
    targets: list[OutputTarget] = []
    for path, what in ((out, "--out"), (dump_logits, "--dump-logits"), *extra):
        if path is not None:
            targets.append(target(path, what))
    if trace_dir is not None:
        targets.append(target(trace_dir, "--dump-cache-trace", directory=True))
    protected = [Path(os.path.realpath(d)) for d in inputs if d is not None]
    for t in targets:
        if t.kind != "stream":
            _check_not_inside(t, protected)
    _check_distinct(targets)
    for t in targets:
        if t.kind == "file":
            _probe_dir(t.real.parent, t)
        elif t.kind == "dir":
            _make_dir(t)
            _probe_dir(t.real, t)
        elif not t.is_stdout and not os.access(t.real, os.W_OK):
            raise OutputError(f"cannot write {t.what} {t.given}: permission denied")
    return targets


def _check_not_inside(t: OutputTarget, protected: list[Path]) -> None:
    where = Path(os.path.realpath(t.real))
    for d in protected:
        if where == d or d in where.parents:
            raise OutputError(f"cannot write {t.what} {t.given}: it is inside {d}, which this "
                              "run reads; write it somewhere else")


def _check_distinct(targets: list[OutputTarget]) -> None:
    seen: dict[tuple[object, ...], OutputTarget] = {}
    for t in targets:
        ids = [t.identity()]
        if t.kind == "dir":  # the trace files inside it
            ids = [OutputTarget(t.real / n, t.what, "file", t.real / n).identity()
                   for n in TRACE_FILES]
        for ident in ids:
            other = seen.get(ident)
            if other is not None:
                raise OutputError(f"cannot write {t.what} {t.given}: {other.what} "
                                  f"{other.given} is the same place; give each output its "
                                  "own path")
            seen[ident] = t


def _make_dir(t: OutputTarget) -> None:
    try:
        t.real.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"cannot write {t.what} {t.given}: it exists and is not a "
                          "directory") from None
    except OSError as exc:
        raise OutputError(f"cannot write {t.what} {t.given}: {exc.strerror or exc}") from None


def _probe_dir(parent: Path, t: OutputTarget) -> None:
    """Create and remove an empty file where the output will be written."""
    if not parent.exists():
        raise OutputError(f"cannot write {t.what} {t.given}: directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"cannot write {t.what} {t.given}: {parent} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".k3-probe.", suffix=".tmp", dir=parent)
    except PermissionError:
        raise OutputError(f"cannot write {t.what} {t.given}: directory {parent} is not "
                          "writable") from None
    except OSError as exc:
        raise OutputError(f"cannot write {t.what} {t.given}: a file cannot be created in "
                          f"{parent} ({exc.strerror or exc})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def check_writable(path: Path, what: str) -> None:
    """Refuse early when ``path`` cannot be written (one output; see :func:`check_outputs`)."""
    t = target(path, what)
    if t.kind == "file":
        _probe_dir(t.real.parent, t)


# ---- writing -----------------------------------------------------------------------------
def write_bytes_atomic(path: Path, data: bytes, what: str = "output") -> None:
    """Write ``data`` to ``path`` as its kind asks (see the module docstring)."""
    t = target(path, what)
    if t.kind == "stream":
        _write_stream(t, data)
        return
    dest = t.real
    try:
        mode = stat.S_IMODE(os.stat(dest).st_mode)
    except OSError:
        mode = new_file_mode()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        tmp = None
    except OSError as exc:
        raise OutputError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _write_stream(t: OutputTarget, data: bytes) -> None:
    try:
        if t.is_stdout:
            sys.stdout.flush()
            out = getattr(sys.stdout, "buffer", None)
            if out is None:  # a text-only stdout (a test harness): bytes as text
                sys.stdout.write(data.decode("utf-8", "surrogateescape"))
            else:
                out.write(data)
            sys.stdout.flush()
            return
        num = descriptor_number(t.real)
        if num is not None:  # the descriptor itself, after what Python buffered for it
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            _write_all(num, data)
            return
        fd = os.open(t.real, os.O_WRONLY | os.O_APPEND | getattr(os, "O_BINARY", 0))
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
    except OSError as exc:
        raise OutputError(f"cannot write {t.what} {t.given}: {exc.strerror or exc}") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_json_atomic(path: Path, obj: Any, what: str = "output") -> None:
    write_bytes_atomic(path, (json.dumps(obj) + "\n").encode(), what)


def write_logits(path: Path, logits: np.ndarray) -> None:
    """Raw little-endian float32, no header (the reference's ``--dump-logits`` format)."""
    write_bytes_atomic(path, np.asarray(logits, dtype="<f4").tobytes(), "--dump-logits")
