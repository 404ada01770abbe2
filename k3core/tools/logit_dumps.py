"""Two raw float32 logit dumps read side by side in fixed-size chunks (``k3 cmp-logits``).

A dump is little-endian float32 values, no header. :meth:`DumpPair.open` checks both files
before reading a byte of either: each must be a regular file whose size is a non-zero
multiple of 4, and the two sizes must be equal; anything else is a ``UsageError`` (exit 2).
It then reads :data:`CHUNK` values of each at a time (``os.pread``), so comparing two dumps
of any size holds a few MB. :meth:`DumpPair.of` gives in-memory arrays the same interface.

:func:`streamed_sum` adds values addressed by position the way NumPy's ``sum`` adds one
contiguous float64 array (its pairwise summation: halves rounded to a multiple of 8 above
128 values), handing ranges of at most :data:`CHUNK` to NumPy itself, so a statistic summed
in chunks has the same bits as the one-pass sum over the whole array.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from k3core.api.errors import UsageError

#: values read from each dump at a time (1 MB of each file)
CHUNK = 1 << 18
#: NumPy's pairwise-summation block: ranges up to this are summed with eight accumulators
_PW_BLOCK = 128


def dump_values(path: Path) -> int:
    """The float32 values ``path`` holds, from its size alone (nothing is read)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file")
    size = st.st_size
    if size == 0 or size % 4:
        raise UsageError(f"{path}: {size} bytes is not a raw float32 logit dump (needs a non-zero "
                         "multiple of 4 bytes)")
    return size // 4


class DumpPair:
    """Dumps A and B of ``n`` values each, read ``chunk`` values at a time."""

    def __init__(self, n: int, read: Callable[[int, int], tuple[np.ndarray, np.ndarray]],
                 chunk: int = CHUNK, close: Callable[[], None] | None = None):
        if chunk < _PW_BLOCK:
            raise ValueError(f"chunk must be at least {_PW_BLOCK} values")
        self.n = n
        self.chunk = chunk
        self._read = read
        self._close = close

    @classmethod
    def of(cls, a: np.ndarray, b: np.ndarray, chunk: int = CHUNK) -> DumpPair:
        """Two in-memory arrays of the same length (float32 values)."""
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise UsageError(f"the dumps differ in size: {a.size} vs {b.size} float32 values; "
                             "they are not logits of the same model")
        xa, xb = a.reshape(-1), b.reshape(-1)
        return cls(xa.size, lambda lo, hi: (xa[lo:hi], xb[lo:hi]), chunk)

    @classmethod
    def open(cls, a: str | Path, b: str | Path, chunk: int = CHUNK) -> DumpPair:
        """Check both files' sizes (refusing before any read), then open them."""
        pa, pb = Path(a), Path(b)
        na, nb = dump_values(pa), dump_values(pb)
        if na != nb:
            raise UsageError(f"{pa} holds {na} float32 values and {pb} holds {nb}; refusing to "
                             "compare dumps of different sizes")
        fds: list[int] = []
        try:
            for p in (pa, pb):
                fds.append(os.open(p, os.O_RDONLY))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise UsageError(f"{p}: cannot read: {exc.strerror or exc}") from None

        def read(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
            xa, xb = (_pread(fd, p, lo, hi) for fd, p in zip(fds, (pa, pb), strict=True))
            return xa, xb

        def close() -> None:
            for fd in fds:
                os.close(fd)

        return cls(na, read, chunk, close)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> DumpPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Values ``lo..hi-1`` of A and of B (float32, read-only)."""
        return self._read(lo, hi)

    def chunks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(start, a, b)`` for each chunk, in order."""
        for lo in range(0, self.n, self.chunk):
            a, b = self.read(lo, min(lo + self.chunk, self.n))
            yield lo, a, b


def _pread(fd: int, path: Path, lo: int, hi: int) -> np.ndarray:
    want = (hi - lo) * 4
    parts: list[bytes] = []
    got = 0
    while got < want:
        try:
            piece = os.pread(fd, want - got, lo * 4 + got)
        except OSError as exc:
            raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
        if not piece:
            raise UsageError(f"{path}: the file shrank while it was being read (wanted bytes "
                             f"up to {hi * 4}, it ends at {lo * 4 + got})")
        parts.append(piece)
        got += len(piece)
    return np.frombuffer(parts[0] if len(parts) == 1 else b"".join(parts), dtype="<f4")


class FiniteView:
    """The values of A and B at the positions where both are finite, as float64, addressed
    by their rank among those positions (what ``a[both]`` would index), read a chunk at a
    time: ``counts[i]`` is how many such positions chunk ``i`` of ``pair`` holds."""

    def __init__(self, pair: DumpPair, counts: list[int]):
        self.pair = pair
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.m = int(self.starts[-1])
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    def _chunk(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is None or self._cached[0] != i:
            lo = i * self.pair.chunk
            a, b = self.pair.read(lo, min(lo + self.pair.chunk, self.pair.n))
            both = np.isfinite(a) & np.isfinite(b)
            if not both.all():
                a, b = a[both], b[both]
            self._cached = (i, a.astype(np.float64), b.astype(np.float64))
        return self._cached[1], self._cached[2]

    def range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Finite values of rank ``lo..hi-1``: ``(x, y)`` contiguous float64 arrays."""
        i = int(np.searchsorted(self.starts, lo, side="right")) - 1
        xs: list[np.ndarray] = []
        ys: list[np.ndarray] = []
        while lo < hi:
            end = int(self.starts[i + 1])
            if end > lo:
                x, y = self._chunk(i)
                s = int(self.starts[i])
                xs.append(x[lo - s : min(hi, end) - s])
                ys.append(y[lo - s : min(hi, end) - s])
                lo = min(hi, end)
            i += 1
        if len(xs) == 1:
            return np.ascontiguousarray(xs[0]), np.ascontiguousarray(ys[0])
        return np.concatenate(xs), np.concatenate(ys)


def streamed_sum(n: int, leaf: Callable[[int, int], tuple[float, ...]], leaf_max: int,
                 lo: int = 0) -> tuple[float, ...]:
    """Sums over positions ``lo..lo+n-1`` in NumPy's pairwise order: ``leaf(a, b)`` returns
    ``np.sum`` of each summed quantity over ``a..b-1`` (at most ``leaf_max`` positions,
    ``leaf_max`` >= 128), split exactly where NumPy splits the whole array."""
    if n <= leaf_max:
        return tuple(float(s) for s in leaf(lo, lo + n))
    half = n // 2
    half -= half % 8
    left = streamed_sum(half, leaf, leaf_max, lo)
    right = streamed_sum(n - half, leaf, leaf_max, lo + half)
    return tuple(x + y for x, y in zip(left, right, strict=True))
