"""Strict parsing of ``--ids`` and other id lists: every piece must be a whole integer."""

from __future__ import annotations

import re

from k3core.api.errors import UsageError

_SPLIT = re.compile(r"[,\s]+")


def parse_ids(text: str, flag: str = "--ids") -> list[int]:
    pieces = [p for p in _SPLIT.split(text.strip()) if p]
    if not pieces:
        raise UsageError(f"no prompt ids parsed from {flag} {text!r}")
    out = []
    for p in pieces:
        if not p.isdigit():
            raise UsageError(f"bad {flag} value {p!r}: ids are non-negative integers, e.g. 3,7,11")
        out.append(int(p))
    return out


def check_vocab(ids: list[int], vocab: int, flag: str = "--ids") -> None:
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise UsageError(f"{flag}: id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
