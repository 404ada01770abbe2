"""Locate the outside oracle (``../shared/fixtures`` or ``$K3_FIXTURES``).

A test that needs the fixtures and cannot find them fails loudly; it never skips.
"""

from __future__ import annotations

import os
from pathlib import Path


def fixtures_dir() -> Path:
    env = os.environ.get("K3_FIXTURES")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidates.append(parent / "shared" / "fixtures")
        candidates.append(parent.parent / "shared" / "fixtures")
    candidates.append(Path.cwd().parent / "shared" / "fixtures")
    for c in candidates:
        if (c / "README.md").is_file():
            return c
    raise FileNotFoundError(
        "k3 test fixtures not found: set K3_FIXTURES or lay shared/fixtures beside the checkout"
    )
