"""Keep Numba's on-disk kernel cache consistent with the kernel sources.

Numba keys a cached kernel on its own source file only. A kernel in ``matmul.py`` has the
primitives of ``exact.py`` compiled into it, so after an edit to ``exact.py`` Numba would
happily load stale machine code for ``matmul.py``. :func:`drop_stale` closes that hole: it
hashes every source file of this package and, when the hash differs from the one recorded
next to the cache, deletes this package's cached kernels before anything loads them. An
installed (unchanging) package pays one hash of a few small files per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

_PKG = Path(__file__).resolve().parent
_STAMP_PREFIX = "k3-numba-kernels-"


def sources_digest() -> str:
    """SHA-256 over the names and contents of this package's ``.py`` files."""
    h = hashlib.sha256()
    for path in sorted(_PKG.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def drop_stale(dispatchers: Iterable[object]) -> list[Path]:
    """Delete cached kernels of this package compiled from other sources; return them."""
    digest = sources_digest()
    stems = {p.stem for p in _PKG.glob("*.py")}
    removed: list[Path] = []
    for cache_dir in {Path(p) for p in _cache_dirs(dispatchers)}:
        stamp = cache_dir / f"{_STAMP_PREFIX}{digest}"
        if stamp.exists():
            continue
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for f in cache_dir.iterdir():
                stale_kernel = f.suffix in (".nbi", ".nbc") and f.name.split(".")[0] in stems
                if stale_kernel or f.name.startswith(_STAMP_PREFIX):
                    f.unlink()
                    removed.append(f)
            stamp.touch()
        except OSError:  # a read-only cache: nothing was written there by these sources
            continue
    return removed


def _cache_dirs(dispatchers: Iterable[object]) -> list[str]:
    out = []
    for d in dispatchers:
        cache = getattr(d, "_cache", None)
        path = getattr(cache, "_cache_path", None)
        if isinstance(path, str):
            out.append(path)
    return out


def cold(dispatchers: Iterable[object]) -> bool:
    """True when no compiled kernel of this package is cached yet (the first step compiles)."""
    stems = {p.stem for p in _PKG.glob("*.py")}
    for cache_dir in {Path(p) for p in _cache_dirs(dispatchers)}:
        try:
            if any(f.suffix == ".nbi" and f.name.split(".")[0] in stems
                   for f in cache_dir.iterdir()):
                return False
        except OSError:
            continue
    return True
