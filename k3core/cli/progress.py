"""Progress of a long command on stderr: done/total, percent, rate and ETA, never on stdout.

One :class:`Progress` is one task (``k3 perplexity``'s windows, ``k3 pack-trunk``'s bytes).
The engine's rooms never print: a tool takes a plain callback (``progress(done, total)``)
and the command hands it :meth:`Progress.update`.

* **Terminal** (stderr is a tty and ``TERM`` is not ``dumb``): one line redrawn in place
  with ``\\r`` at most :data:`REDRAW` times a second, cut to the terminal's width, ended by a
  newline when the task ends (or fails, so the ``k3: error:`` line starts on its own line).
* **Not a terminal** (a log, a pipe): a plain line at most every ``K3_PROGRESS_EVERY``
  seconds (default :data:`EVERY`; ``0`` prints every update), and a last line when the task
  ends if any was printed, so a short run prints nothing and a long one a few lines.
* **Quiet** (``-q``): nothing at all.

Messages about what is happening (:meth:`note`) go to stderr as whole lines in every mode
but quiet; in a terminal the bar is cleared first and drawn again after.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

#: most redraws a second in a terminal
REDRAW = 10
#: default seconds between plain lines when stderr is not a terminal
EVERY = 5.0
ENV_EVERY = "K3_PROGRESS_EVERY"
#: seconds before an ETA is shown, unless 5 % is already done (the first moments' rate is noise)
ETA_AFTER = 1.0


def plain_every() -> float:
    """Seconds between plain lines (``K3_PROGRESS_EVERY``; a bad value is the default)."""
    raw = os.environ.get(ENV_EVERY, "").strip()
    try:
        v = float(raw) if raw else EVERY
    except ValueError:
        return EVERY
    return v if v >= 0 and v == v and v != float("inf") else EVERY


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


def duration(seconds: float) -> str:
    """``7 s``, ``2:05``, ``1:02:03``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _bytes(n: float, digits: int = 2) -> str:
    """Decimal units, as ``human()`` in ``k3core.api.units``, with ``digits`` decimals."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{int(n)} B"


class Progress:
    """One task's progress on stderr (see the module docstring); a context manager."""

    def __init__(self, label: str, total: float | None = None, *, unit: str = "",
                 byte_units: bool = False, quiet: bool = False, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.label = label
        self.total = total
        self.unit = unit
        self.byte_units = byte_units
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = not quiet and is_terminal(self.stream)
        self.every = plain_every()
        self.clock = clock
        self.start = clock()
        self.done: float = 0
        self.note_text = ""
        self._last = float("-inf")  # last draw (terminal) or plain line
        self._drawn = False  # a terminal line is on screen, not yet ended
        self._printed = False  # a plain line was printed
        self._closed = False
        self._lock = threading.Lock()

    # -- the task's side --------------------------------------------------------------
    def update(self, done: float, total: float | None = None, note: str | None = None) -> None:
        """``done`` so far (absolute), and the total or a note when they change."""
        with self._lock:
            self.done = done
            if total is not None:
                self.total = total
            if note is not None:
                self.note_text = note
            self._maybe_show()

    def callback(self) -> Callable[[int, int], None]:
        """``progress(done, total)``, the shape the tools take."""
        return lambda done, total: self.update(done, total)

    def note(self, message: str) -> None:
        """A whole line about what is happening (quiet: nothing)."""
        if self.quiet:
            return
        with self._lock:
            if self._drawn:
                self._write("\r\x1b[K")
                self._drawn = False
            self._write(f"{message}\n")
            if self.terminal and not self._closed and self._last > float("-inf"):
                self._draw()

    def close(self, ok: bool = True) -> None:
        """End the task: the final figures (terminal, or after plain lines) and a newline."""
        with self._lock:
            if self._closed or self.quiet:
                self._closed = True
                return
            self._closed = True
            if self.terminal:
                if ok and self._last > float("-inf"):  # drawn before: now its final figures
                    self._draw(final=True)
                if self._drawn:
                    self._write("\n")
                    self._drawn = False
            elif self._printed or (self.every == 0 and ok):
                self._write(self.text(final=ok) + "\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(ok=kind is None)

    # -- drawing ----------------------------------------------------------------------
    def _maybe_show(self) -> None:
        if self.quiet or self._closed:
            return
        now = self.clock()
        if self.terminal:
            if now - self._last >= 1.0 / REDRAW:
                self._last = now
                self._draw()
        elif now - max(self._last, self.start) >= self.every:
            self._last = now
            self._printed = True
            self._write(self.text() + "\n")

    def _draw(self, final: bool = False) -> None:
        text = self.text(final=final)
        width = _width(self.stream)
        if len(text) >= width:
            text = text[: max(0, width - 1)]
        self._write(f"\r{text}\x1b[K")
        self._drawn = True

    def _amount(self, n: float) -> str:
        if self.byte_units:
            return _bytes(n)
        return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"

    def _rate(self, per_second: float) -> str:
        if self.byte_units:
            return f"{_bytes(per_second, 1)}/s"
        unit = self.unit or "step"
        if per_second >= 1 or per_second == 0:
            return f"{per_second:.3g} {unit}s/s"
        return f"{1 / per_second:.3g} s/{unit}"

    def text(self, final: bool = False) -> str:
        """The line as it stands: ``label: done/total unit (pct%), rate, ETA`` (when ended:
        the time taken instead of the ETA), then the note."""
        elapsed = self.clock() - self.start
        unit = "" if self.byte_units or not self.unit else f" {self.unit}s"
        total = self.total
        if total:
            head = (f"{self._amount(self.done)}/{self._amount(total)}{unit} "
                    f"({100.0 * min(self.done, total) / total:.0f}%)")
        else:
            head = f"{self._amount(self.done)}{unit}"
        parts = [head]
        rate = self.done / elapsed if elapsed > 0 and self.done > 0 else 0.0
        if rate > 0:
            parts.append(self._rate(rate))
        if final:
            parts.append(f"done in {duration(elapsed)}")
        elif total and rate > 0 and (elapsed >= ETA_AFTER or self.done >= 0.05 * total):
            parts.append(f"ETA {duration(max(0.0, total - self.done) / rate)}")
        else:
            parts.append(f"{duration(elapsed)} so far")
        note = f" [{self.note_text}]" if self.note_text else ""
        return f"{self.label}: " + ", ".join(parts) + note

    def _write(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr: progress is not worth dying
            self.quiet = True


def _width(stream: TextIO) -> int:
    try:
        return max(20, os.get_terminal_size(stream.fileno()).columns)
    except (AttributeError, ValueError, OSError):
        return 80


class Stages:
    """A task in named stages, each its own line: ``progress(stage, done, total)``.

    A new stage name ends the line of the one before and starts a new one; :meth:`close`
    ends the last. ``units`` names each stage's unit (``"B"``: bytes, in decimal units). For tools whose work comes in phases of different cost (``k3 bench
    decode``: the timed decode runs, the prefill runs, the numpy check).
    """

    def __init__(self, label: str, *, quiet: bool = False, units: dict[str, str] | None = None,
                 stream: TextIO | None = None):
        self.label = label
        self.quiet = quiet
        self.units = units or {}
        self.stream = stream
        self.current: Progress | None = None
        self.stage = ""

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.current is None or stage != self.stage:
            if self.current is not None:
                self.current.close()
            self.stage = stage
            unit = self.units.get(stage, "step")
            self.current = Progress(f"{self.label} ({stage})", total, quiet=self.quiet,
                                    unit=unit, byte_units=unit == "B", stream=self.stream)
        self.current.update(done, total)

    def note(self, message: str) -> None:
        """A whole line on stderr (quiet: nothing), above the current stage's line."""
        if self.current is not None:
            self.current.note(message)
        else:
            Progress(self.label, quiet=self.quiet, stream=self.stream).note(message)

    def close(self, ok: bool = True) -> None:
        if self.current is not None:
            self.current.close(ok)
            self.current = None

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(ok=kind is None)
