"""``k3 chat``'s line reader: line editing and a history kept across sessions, in a terminal.

When standard input and output are both a terminal and the standard library's ``readline``
imports, ``input()`` edits the line (arrows, Home/End, Ctrl-A/E/K/U/W, ...) and Up/Down walk
the history. The history file holds the last :data:`HISTORY_LENGTH` lines typed; it is read
when the chat starts and written (mode 0600: it holds what was typed) when it ends:

* ``$K3_CHAT_HISTORY`` names the file; set to the empty string it turns the file off;
* else ``$XDG_STATE_HOME/k3/chat_history`` (when that variable is an absolute path);
* else ``~/.local/state/k3/chat_history``.

``k3 chat --no-history`` reads and writes no file (the session's own lines are still there
under Up). Where ``readline`` is missing, or input is piped, lines are read as before:
nothing is edited, nothing recorded. A history file that cannot be read or written costs one
``note:`` line on stderr, never the conversation.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

#: lines the history keeps (in memory and in the file)
HISTORY_LENGTH = 1000
ENV_FILE = "K3_CHAT_HISTORY"


def history_path() -> Path | None:
    """The history file (see the module docstring); ``None`` when turned off."""
    named = os.environ.get(ENV_FILE)
    if named is not None:
        return Path(named).expanduser() if named.strip() else None
    state = os.environ.get("XDG_STATE_HOME", "")
    root = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return root / "k3" / "chat_history"


def _interactive() -> bool:
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _readline() -> ModuleType | None:
    try:
        import readline
    except ImportError:  # a Python built without it: plain input, as piped
        return None
    return readline


class LineReader:
    """Reads the user's lines; in a terminal with ``readline``, edited and remembered."""

    def __init__(self, history: bool = True):
        self.readline = _readline() if _interactive() else None
        self.path = history_path() if history and self.readline is not None else None
        if self.readline is None:
            return
        self.readline.set_history_length(HISTORY_LENGTH)
        if self.path is not None and self.path.exists():
            try:
                self.readline.read_history_file(str(self.path))
            except OSError as exc:
                _note(f"chat history not read from {self.path}: {exc.strerror or exc}")
                self.path = None  # never overwrite a file that could not be read

    def read(self, prompt: str) -> str:
        """One line (``EOFError`` at the end of input, ``KeyboardInterrupt`` on Ctrl-C)."""
        return input(prompt)

    def close(self) -> None:
        """Write the history file (the last :data:`HISTORY_LENGTH` lines)."""
        if self.readline is None or self.path is None:
            return
        path, self.path = self.path, None
        if self.readline.get_current_history_length() == 0:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not path.exists():  # created private before readline writes into it
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            self.readline.write_history_file(str(path))
        except OSError as exc:
            _note(f"chat history not saved to {path}: {exc.strerror or exc}")


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)
