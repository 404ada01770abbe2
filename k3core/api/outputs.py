"""Where every output goes: the one check before anything is written, and the writers.

Every path k3 writes (``k3 run``'s ``--out``, ``--dump-logits``, ``--dump-cache-trace`` and
``--save-state``, ``Session.save`` and ``k3 chat``'s ``/save``, ``k3 sim-cache --plot``,
``k3 tune``'s preset, ``k3 synth``, ``k3 pack-trunk`` and ``k3 bench-ladder``'s directories)
is checked here, against the inputs the command reads, before anything is written.

An output path is one of three kinds of :class:`OutputTarget`:

* a **stream**: ``-`` (standard output), a FIFO or a character device such as
  ``/dev/null`` (once symlinks are followed), or a name of a descriptor
  this process already has open (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
  ``/proc/self/fd/N``, directly or through symlinks: written to that descriptor, after what
  Python buffered for it). A stream is written in place (opened for appending, never
  created, truncated or renamed over);
* a **file**: a regular file, or a name that does not exist yet. It is written atomically:
  a partial file in the same directory (:mod:`k3core.api.partials`: removed on any exit
  the process can catch, and by the next writer if the process was killed), fsync, rename.
  A symlink is written *through*: its target is replaced and the link is kept. A replaced
  file keeps its permission bits; a new one gets ``0666`` less the umask;
* a **directory** (``--dump-cache-trace DIR``, ``k3 synth``'s and ``k3 pack-trunk``'s
  output): what is written inside it is named (:class:`Output` ``files``); each of those
  that exists must be a regular file (a FIFO or device there is refused, since the files
  are renamed into place), and a stream given as a directory is refused.

:func:`check_outputs` is the pre-flight. It refuses (``OutputError``, exit 3):

* an output that is, or lands inside, an input the command reads: the model directory, the
  packed trunk, the tokenizer directory (``--tok``), and each input file (the prompt file,
  ``--config``, a preset file, the replayed trace, the session being loaded); a directory
  output may not be an input directory or lie inside one either;
* two outputs at one place (the same path, or links to one file);
* a target that is a directory, a directory output that exists and is not one, a block
  device or a socket;
* a file whose directory is missing, read-only or cannot hold a file at all
  (``/proc/x.json``: it creates and removes a probe file, which also answers for root,
  whom permission bits do not stop).

A stream is never refused for being an input: it is written in place and replaces nothing.
A file k3 writes is either complete or absent; a failure is an ``OutputError`` (exit 3).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
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
from k3core.api.partials import Partials, partial_path, space_note, sweep_stale

STDOUT = "-"
#: paths that name a descriptor already open in this process (written in place, never renamed)
_DESCRIPTORS = {"/dev/stdout": 1, "/dev/stderr": 2}
_DESCRIPTOR_PREFIXES = ("/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/")
#: the files ``--dump-cache-trace DIR`` writes or replaces (k3core.experts.trace)
TRACE_FILES = ("expert_trace.bin", "expert_hist.json", "expert_guess.bin")


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
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
        return OutputTarget(p, what, "stream", p)
    kind = "a block device" if stat.S_ISBLK(st.st_mode) else (
        "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
    raise OutputError(f"cannot write {what} {p}: it is {kind}; k3 writes regular files, "
                      "FIFOs and character devices")


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
@dataclass(frozen=True)
class Output:
    """One output to check: its path, the flag (or words) naming it, and for a directory
    output the files written inside it; ``create``: the pre-flight makes the directory
    (else its writer does, and removes it again if the write fails)."""

    path: str | Path | None
    what: str
    directory: bool = False
    files: tuple[str, ...] = ()
    create: bool = True


#: an input the command reads: a path, or ``(path, words naming it)``
InputSpec = str | Path | None | tuple[str | Path | None, str]


@dataclass(frozen=True)
class _Input:
    path: Path  # resolved
    given: str
    directory: bool
    ident: tuple[object, ...]


def _inputs(inputs: Iterable[InputSpec]) -> list[_Input]:
    out: list[_Input] = []
    for spec in inputs:
        path, words = spec if isinstance(spec, tuple) else (spec, "")
        if path is None or str(path) == STDOUT:
            continue
        real = Path(os.path.realpath(path))
        try:
            st = os.stat(real)
            ident: tuple[object, ...] = ("inode", st.st_dev, st.st_ino)
            directory = stat.S_ISDIR(st.st_mode)
            if not (directory or stat.S_ISREG(st.st_mode)):
                continue  # a FIFO or device read as input is not a place a file could clobber
        except OSError:
            ident, directory = ("path", os.path.normcase(str(real))), False
        given = f"{words} {path}" if words else str(path)
        out.append(_Input(real, given, directory, ident))
    return out


def check_outputs(outputs: Iterable[Output | tuple[str | Path | None, str]], *,
                  inputs: Iterable[InputSpec] = ()) -> list[OutputTarget]:
    """Refuse, before anything is written, every output that could not be written or would
    replace what the command reads (see the module docstring); returns the targets.

    ``outputs`` are :class:`Output` records or ``(path, flag)`` pairs (a file each; a
    ``None`` path is skipped). ``inputs`` are the files and directories the command reads,
    each a path or ``(path, words naming it)``. A directory output with ``create`` is
    made here if it does not exist."""
    specs = [o if isinstance(o, Output) else Output(o[0], o[1]) for o in outputs]
    targets: list[tuple[OutputTarget, Output]] = []
    for o in specs:
        if o.path is not None:
            targets.append((target(o.path, o.what, directory=o.directory), o))
    reads = _inputs(inputs)
    for t, o in targets:
        if t.kind != "stream":
            _check_not_an_input(t, reads)
        if t.kind == "dir":
            _check_dir_files(t, o.files, reads)
    _check_distinct(targets)
    for t, o in targets:
        if t.kind == "file":
            _probe_dir(t.real.parent, t)
        elif t.kind == "dir" and o.create:
            _make_dir(t)
            _probe_dir(t.real, t)
        elif t.kind == "stream" and not t.is_stdout and not os.access(t.real, os.W_OK):
            raise OutputError(f"cannot write {t.what} {t.given}: permission denied")
    return [t for t, _ in targets]


def check_output(path: str | Path, what: str, *, inputs: Iterable[InputSpec] = ()) -> OutputTarget:
    """:func:`check_outputs` for one file output."""
    return check_outputs([(path, what)], inputs=inputs)[0]


def refuse_inputs(path: str | Path, what: str, inputs: Iterable[InputSpec]) -> None:
    """The input half of :func:`check_outputs` alone, for an output whose directory may not
    exist yet (its writer makes it): refuse ``path`` if it is or lands inside an input."""
    t = target(path, what)
    if t.kind != "stream":
        _check_not_an_input(t, _inputs(inputs))


def _check_not_an_input(t: OutputTarget, reads: list[_Input]) -> None:
    where = Path(os.path.realpath(t.real))
    ident = t.identity()
    for r in reads:
        if r.directory and (where == r.path or r.path in where.parents):
            inside = "is" if where == r.path else "is inside"
            raise OutputError(f"cannot write {t.what} {t.given}: it {inside} {r.given}, which "
                              "this command reads; write it somewhere else")
        if not r.directory and (ident == r.ident or where == r.path):
            raise OutputError(f"cannot write {t.what} {t.given}: it is {r.given}, which this "
                              "command reads; write it somewhere else")


def _check_dir_files(t: OutputTarget, files: tuple[str, ...], reads: list[_Input]) -> None:
    """The files a directory output writes are renamed into place: each must be a regular
    file (or absent), and none may be an input."""
    for name in files:
        inner = t.real / name
        try:
            st = os.lstat(inner)
        except OSError:
            st = None
        if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise OutputError(f"cannot write {t.what} {t.given}: {inner} exists and is not a "
                              "regular file (k3 writes it under a temporary name and renames "
                              "it into place); remove it or write elsewhere")
        sub = OutputTarget(Path(inner), t.what, "file", inner)
        for r in reads:
            if not r.directory and (sub.identity() == r.ident or inner == r.path):
                raise OutputError(f"cannot write {t.what} {t.given}: it would replace "
                                  f"{r.given} ({inner}), which this command reads; write it "
                                  "somewhere else")


def _check_distinct(targets: list[tuple[OutputTarget, Output]]) -> None:
    seen: dict[tuple[object, ...], OutputTarget] = {}
    for t, o in targets:
        ids = [t.identity()]
        if t.kind == "dir":  # the files inside it
            ids = [OutputTarget(t.real / n, t.what, "file", t.real / n).identity()
                   for n in o.files]
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


def existing_parent(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where an output not yet created will
    live: its free space, its device)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


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
    with Partials() as parts:
        tmp = None
        try:
            sweep_stale(dest.parent, [dest.name])
            tmp = stage_bytes(dest, data, parts, mode=mode)
            os.replace(tmp, dest)
            parts.keep(tmp)
        except OSError as exc:
            raise OutputError(_cannot(what, path, exc, dest, len(data))) from exc


def stage_bytes(dest: Path, data: bytes, parts: Partials, *, mode: int | None = None) -> Path:
    """Write ``data`` to a new partial file of ``dest`` (registered in ``parts``), fsynced,
    with ``mode`` (default: a new file's); returns its path. The caller renames it."""
    tmp = parts.add(partial_path(dest, secrets.token_hex(4)))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        if hasattr(os, "fchmod"):
            os.fchmod(f.fileno(), new_file_mode() if mode is None else mode)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _cannot(what: str, path: str | Path, exc: OSError, dest: Path, needed: int | None) -> str:
    """``cannot write WHAT PATH: REASON``, with the room it needs after ENOSPC."""
    msg = f"cannot write {what} {path}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        note = space_note(dest.parent, [dest.name], needed)
        if note:
            msg += f" ({note})"
    return msg


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
