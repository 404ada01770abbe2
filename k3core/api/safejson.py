"""Strict JSON for untrusted files: UTF-8 only, no duplicate keys, no NaN, bounded nesting.

Python's ``json`` accepts things a careful reader must not: ``NaN``/``Infinity`` literals,
repeated keys (the last silently wins), UTF-16/32 when handed bytes, and nesting deep enough
to raise ``RecursionError``. :func:`parse_json` refuses all of them with a
:class:`JSONRejected` whose message says why; callers turn it into their own ``K3Error``.
"""

from __future__ import annotations

import json
from typing import Any


class JSONRejected(Exception):
    """The bytes are not strict JSON; ``str(exc)`` says why in a few words."""


class _Reject(Exception):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Reject(f"duplicate key {show(key)}")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise _Reject(f"{name} is not a JSON number")


def parse_json(data: bytes | bytearray | memoryview) -> Any:
    """Parse ``data`` (UTF-8 bytes) strictly; raise :class:`JSONRejected` on any problem."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONRejected(f"not UTF-8 (invalid byte at offset {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except _Reject as exc:
        raise JSONRejected(str(exc)) from None
    except RecursionError:
        raise JSONRejected("JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int() digit-limit errors
        raise JSONRejected(f"invalid JSON ({exc})") from None


def show(text: str, limit: int = 120) -> str:
    """``text`` quoted for a one-line message: escapes control and unencodable characters."""
    shown = ascii(text) if not text.isprintable() or not encodable(text) else repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates from ``\\udXXX`` escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (for messages: "got a string")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__
