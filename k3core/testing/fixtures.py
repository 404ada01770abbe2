"""Locate the outside oracle: ``$K3_FIXTURES``, else the repository's ``tests/fixtures``.

The fixtures are data of the reference engine's authors (Apache-2.0), vendored unmodified
under ``tests/fixtures/`` with their provenance (``tests/fixtures/README.md``, ``NOTICE``),
so a clone with nothing beside it runs every test. ``K3_FIXTURES`` points the tests at
another copy. A test that needs the fixtures and cannot find them fails loudly; it never
skips.
"""

from __future__ import annotations

import os
from pathlib import Path

#: a file every complete copy of the fixtures has
_MARKER = Path("ops") / "MANIFEST.json"


def fixtures_dir() -> Path:
    """The fixtures folder: ``$K3_FIXTURES`` when set, else ``tests/fixtures`` of the checkout."""
    env = os.environ.get("K3_FIXTURES")
    if env:
        if not (Path(env) / _MARKER).is_file():
            raise FileNotFoundError(f"K3_FIXTURES={env} holds no k3 test fixtures "
                                    f"({_MARKER} is missing)")
        return Path(env)
    starts = [Path(__file__).resolve().parent, Path.cwd().resolve()]
    for start in starts:
        for parent in (start, *start.parents):
            c = parent / "tests" / "fixtures"
            if (c / _MARKER).is_file():
                return c
    raise FileNotFoundError(
        "k3 test fixtures not found: run the tests from a checkout (they are in "
        "tests/fixtures) or set K3_FIXTURES"
    )
