"""The default suite's share of a parameter matrix.

``make test`` stays near ten minutes on two cores by running one or two values of a long
axis (a storage backend, a kernel backend, a cache policy) and leaving the rest to
``make test-long`` (``-m slow``), which runs every value. The kept values are chosen to take
every code path the axis has (an unbuffered and a mapped storage backend; a compiled kernel
backend, whose bytes the kernel conformance suite holds to the NumPy reference's at every
thread count), so a fault on a path still fails the default suite.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest

SLOW = pytest.mark.slow


def thinned(values: Iterable[Any], keep: Sequence[Any]) -> list[Any]:
    """``values`` as parameters, every one but those in ``keep`` marked slow."""
    return [pytest.param(v, marks=() if v in keep else (SLOW,)) for v in values]
