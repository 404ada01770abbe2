"""Partial files: an output being written, removed on every exit this process can catch.

An output k3 writes is first written under a *partial* name in its own directory,
``.NAME.partial-PID`` (or ``.NAME.partial-PID-TAG`` where one process may write the same
name twice at once), and renamed to ``NAME`` only when complete. The PID in the name says
whose it is:

* **its own**: a writer registers a partial in :class:`Partials` for as long as it is
  being written. It is removed when the writer raises (any exception, Ctrl-C included), and
  on SIGTERM and SIGHUP, whose handlers (installed while a partial is registered, from the
  main thread, unless the signal was ignored) remove every registered partial, say so in
  one line on stderr and then let the signal end the process as it would have (a handler
  the program had set is called instead). SIGKILL and a power cut cannot be caught; the
  next writer of the same name cleans up after them:
* **a dead process's**: :func:`sweep_stale` (every writer calls it before writing) removes
  the partials of ``NAME`` whose process no longer runs (or whose PID a process started
  after the partial was last written now holds) and names each on stderr. A partial of a
  live process (another k3 still writing) is left alone;
* when a write fails for lack of space, :func:`space_note` names what is taking it: the
  partials of ``NAME`` that are still there (a live process's, or one that could not be
  removed), with their sizes, and the bytes the write needs against what is free.

A PID is only meaningful on the machine that wrote it: on a shared filesystem a partial of
a process on another machine whose PID is not running here counts as stale.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from k3core.api.errors import OutputError
from k3core.api.units import human

_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)(?:-[0-9A-Za-z_]+)?$")
#: the signals whose handler removes this process's partials before the process ends
CAUGHT_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s))


def partial_path(final: Path, tag: str = "") -> Path:
    """The partial name of ``final`` for this process (``tag``: one more distinct piece)."""
    return final.parent / f".{final.name}.partial-{os.getpid()}{'-' + tag if tag else ''}"


def parse_partial(name: str) -> tuple[str, int] | None:
    """``(final name, pid)`` of a partial file's name; ``None`` for any other name."""
    m = _PARTIAL.match(name)
    return (m["name"], int(m["pid"])) if m else None


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process ``pid`` runs on this machine (one of another user counts). With
    ``since`` (a partial's modification time), a process started after it is another one
    that reuses the PID, so the writer counts as gone."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process; or cannot tell: keep it
        pass
    if since is not None:
        try:
            started = psutil.Process(pid).create_time()
        except (psutil.Error, OSError):
            return True
        return started <= since + 2.0  # clocks tick in whole seconds on some filesystems
    return True


# ---- this process's partials ----------------------------------------------------------------
_lock = threading.RLock()
_registered: dict[Path, bool] = {}  # path -> is a directory tree
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced


def _remove(path: Path, tree: bool) -> bool:
    """Remove ``path`` (a file, or with ``tree`` a directory and all below); True if gone."""
    try:
        if tree and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _on_signal(signum: int, frame: FrameType | None) -> None:
    with _lock:
        paths = list(_registered.items())
        _registered.clear()
        previous = dict(_previous)
        _restore_handlers()
    # files first, then the directories a writer made, so the message names the files
    paths.sort(key=lambda item: item[1])
    removed = [str(p) + ("/" if tree else "") for p, tree in paths
               if os.path.lexists(p) and _remove(p, tree)]
    name = signal.Signals(signum).name
    with contextlib.suppress(Exception):
        print(f"k3: error: stopped by {name}" + (f"; removed the partial output: "
              f"{', '.join(removed)}" if removed else ""), file=sys.stderr, flush=True)
    handler = previous.get(signum, signal.SIG_DFL)
    if callable(handler):
        handler(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # end as the signal would have ended the process


def _install_handlers() -> None:
    if _previous or threading.current_thread() is not threading.main_thread():
        return
    for sig in CAUGHT_SIGNALS:
        try:
            current = signal.getsignal(sig)
            if current == signal.SIG_IGN or current is None:
                continue  # ignored (nohup) or set outside Python: leave it be
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):
            continue
        _previous[sig] = current


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in list(_previous.items()):
        with contextlib.suppress(ValueError, OSError, TypeError):
            if signal.getsignal(sig) == _on_signal:
                signal.signal(sig, handler)
        del _previous[sig]


class Partials:
    """The partials one writer has in flight (see the module docstring).

    ``add`` registers a path; ``keep`` forgets it once it was renamed into place; leaving
    the ``with`` block removes whatever is still registered, however it is left."""

    def __init__(self) -> None:
        self.paths: dict[Path, bool] = {}

    def add(self, path: Path, *, tree: bool = False) -> Path:
        with _lock:
            self.paths[path] = tree
            _registered[path] = tree
            _install_handlers()
        return path

    def keep(self, path: Path) -> None:
        with _lock:
            self.paths.pop(path, None)
            _registered.pop(path, None)
            if not _registered:
                _restore_handlers()

    def discard(self) -> None:
        """Remove every registered partial now."""
        with _lock:
            items = list(self.paths.items())
        for path, tree in items:
            _remove(path, tree)
            self.keep(path)

    def __enter__(self) -> Partials:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


@contextlib.contextmanager
def partial_file(final: Path, tag: str = "") -> Iterator[Path]:
    """A registered partial of ``final`` for one ``with`` block (removed unless renamed)."""
    with Partials() as parts:
        yield parts.add(partial_path(final, tag))


@contextlib.contextmanager
def whole_tree(out: Path, failure: str, *, replace: bool = False) -> Iterator[Path]:
    """A directory written whole or not at all (``k3 synth``'s and ``k3 shard-experts``'
    outputs): the ``with`` block writes into the yielded partial directory beside ``out``.

    Stale partials of dead processes beside ``out`` go first; the partial is registered
    (removed on an error, SIGTERM or SIGHUP) and, once the block ends, takes ``out``'s place
    in one rename. ``out`` must be absent or empty, or, with ``replace``, a tree the caller
    has checked may go. An ``OSError`` (in the block too) becomes an :class:`OutputError`:
    ``failure`` (e.g. ``cannot write OUT_DIR /x``), the error, and on a full disk the
    partials that hold space.
    """
    if out.parent.is_dir():
        sweep_stale(out.parent, [out.name])
    with Partials() as parts:
        tmp = parts.add(partial_path(out), tree=True)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            yield tmp
            if out.exists():
                if replace:
                    shutil.rmtree(out)
                else:
                    out.rmdir()
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, out)
            parts.keep(tmp)
        except OSError as exc:
            note = (space_note(out.parent, [out.name])
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "")
            raise OutputError(f"{failure}: {exc.strerror or exc}"
                              + (f" ({note})" if note else "")) from exc


# ---- other processes' partials --------------------------------------------------------------
@dataclass(frozen=True)
class Leftover:
    """A partial of another process found beside an output."""

    path: Path
    pid: int
    nbytes: int
    alive: bool

    def describe(self) -> str:
        who = "still running" if self.alive else "no longer running"
        return f"{self.path} ({human(self.nbytes)}, process {self.pid}, {who})"


def _size(path: Path) -> int:
    """Bytes ``path`` holds on disk (a tree: every file below it)."""
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(_size(p) for p in path.iterdir())
        st = os.lstat(path)
        blocks = getattr(st, "st_blocks", None)
        return int(blocks * 512) if blocks is not None else int(st.st_size)
    except OSError:
        return 0


def leftovers(directory: Path, finals: Iterable[str]) -> list[Leftover]:
    """Partials of ``finals`` in ``directory`` that belong to other processes."""
    wanted = set(finals)
    out: list[Leftover] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return out
    for entry in entries:
        parsed = parse_partial(entry.name)
        if parsed is None or parsed[0] not in wanted or parsed[1] == os.getpid():
            continue
        path = Path(entry.path)
        try:
            since: float | None = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            since = None
        out.append(Leftover(path, parsed[1], _size(path), pid_alive(parsed[1], since)))
    return out


def sweep_stale(directory: Path, finals: Iterable[str],
                say: Callable[[str], None] | None = None) -> list[Leftover]:
    """Remove the partials of ``finals`` in ``directory`` left by processes that no longer
    run, naming each (``say``, default stderr); returns the ones still there."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    kept: list[Leftover] = []
    for left in leftovers(directory, finals):
        if left.alive:
            say(f"note: {left.path} is the partial output of process {left.pid}, which is "
                "still running; left alone")
            kept.append(left)
        elif _remove(left.path, tree=True):
            say(f"note: removed {left.path} ({human(left.nbytes)}), the partial output of "
                f"process {left.pid}, which is no longer running")
        else:
            say(f"note: could not remove {left.path} ({human(left.nbytes)}), the partial "
                f"output of process {left.pid}, which is no longer running")
            kept.append(left)
    return kept


def space_note(directory: Path, finals: Iterable[str], needed: int | None = None) -> str:
    """What to say after ENOSPC: the bytes needed against free, and the partials of
    ``finals`` there that take room (empty when there is nothing to add)."""
    parts: list[str] = []
    try:
        free: int | None = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if needed is not None:
        parts.append(f"it needs {human(needed)}" + (f", {human(free)} free" if free is not None
                                                     else ""))
    elif free is not None:
        parts.append(f"{human(free)} free")
    taking = leftovers(directory, finals)
    if taking:
        parts.append("partial outputs of other processes take room there: "
                     + "; ".join(left.describe() for left in taking))
    return "; ".join(parts)
