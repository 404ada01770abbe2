"""The one error type k3 raises on purpose, and the exit codes it maps to.

Every refusal in k3 is a :class:`K3Error` (or a subclass) carrying a message meant for a
person and an exit code from :class:`Exit`. The command line catches these and prints one
line; anything else escaping is a bug. ``docs/exit-codes.md`` lists the families.

A message names the caller's parameters in the caller's words: the library writes a
parameter as :func:`param` (``f"{param('max_tokens')} must be in 0..4096"``), which reads
``max_tokens`` from Python; the command line shows the flag instead (``--gen must be in
0..4096``) through :meth:`K3Error.in_words` and its one table of flags
(``k3core/cli/options.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import IntEnum

#: marks a parameter's name inside a message (a NUL byte: no path or text can hold one)
_MARK = "\x00"
_PARAM = re.compile(r"\x00(\w+)\x00")


def param(name: str) -> str:
    """``name``, a parameter of k3's Python API, as a message names it: the message reads
    ``name``; :meth:`K3Error.in_words` names it as its caller knows it (a flag)."""
    return f"{_MARK}{name}{_MARK}"


def _words(text: str, names: Mapping[str, str]) -> str:
    return _PARAM.sub(lambda m: names.get(m.group(1), m.group(1)), text)


class Exit(IntEnum):
    """Process exit codes (the reference engine's, kept so scripts can swap engines)."""

    OK = 0
    RUNTIME = 1  # a read, bind, allocation, memory-plan or forward-pass failure
    USAGE = 2  # bad flags, untrusted config, impossible request, unavailable backend
    OUTPUT = 3  # the run finished but an output file could not be written
    DROPS = 4  # the run finished but at least one routed expert was dropped


class K3Error(Exception):
    """A refusal with a message for a person and an exit code."""

    exit_code: Exit = Exit.RUNTIME

    def __init__(self, message: str, *, exit_code: Exit | None = None, hint: str | None = None):
        self._said = (message, hint)
        #: the parameters the message names (:func:`param`), in order
        self.params = tuple(dict.fromkeys(_PARAM.findall(message + (hint or ""))))
        self.message = _words(message, {})
        self.hint = None if hint is None else _words(hint, {})
        super().__init__(self.message)
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  fix: {self.hint}"

    def in_words(self, names: Mapping[str, str]) -> str:
        """The message (and its fix) with each parameter named as ``names`` says (the
        command line's flags); a parameter ``names`` lacks keeps its own name."""
        message, hint = self._said
        said = _words(message, names)
        return said if not hint else f"{said}\n  fix: {_words(hint, names)}"


class UsageError(K3Error):
    """Bad command-line input or an impossible request (exit 2)."""

    exit_code = Exit.USAGE


class ConfigError(K3Error):
    """A config.json that cannot be read with confidence (exit 2)."""

    exit_code = Exit.USAGE


class PluginError(K3Error):
    """Unknown, unavailable or conflicting plugin (exit 2)."""

    exit_code = Exit.USAGE


class TokenizerError(K3Error):
    """A tokenizer file (tiktoken.model, tokenizer_config.json) that cannot be trusted (exit 2)."""

    exit_code = Exit.USAGE


class CheckpointError(K3Error):
    """A malformed, truncated or inconsistent checkpoint file (exit 1)."""

    exit_code = Exit.RUNTIME


class StorageError(K3Error):
    """A failed, short or refused read (exit 1). A failed read is never handed on."""

    exit_code = Exit.RUNTIME


class MemoryPlanError(K3Error):
    """The memory plan exceeds what the machine has (exit 1)."""

    exit_code = Exit.RUNTIME


class OutputError(K3Error):
    """An output file could not be written (exit 3)."""

    exit_code = Exit.OUTPUT


class ExpertDropError(K3Error):
    """A routed expert could not be loaded; the result would be corrupt (exit 4)."""

    exit_code = Exit.DROPS
