"""Compare two raw float32 logit dumps (``k3 run --dump-logits``, the reference's format).

A dump is the little-endian float32 logits of one position, no header. Two dumps must have
the same size, a multiple of 4 bytes, and at least one value; anything else is a
``UsageError`` (exit 2). Statistics are computed in float64 over the positions where both
values are finite; non-finite values are counted, never hidden.

:func:`disagreements` is the verdict ``k3 cmp-logits`` turns into its exit status: the
argmax differs, or (when ``atol``/``rtol`` are given) some value fails
``|A - B| <= atol + rtol * |B|`` (NumPy's ``isclose`` rule; a position where A and B are not
both finite fails unless both hold the same non-finite value).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import UsageError


@dataclass(frozen=True)
class LogitComparison:
    n: int
    max_abs_diff: float
    max_rel_diff: float  # max |A - B| / max |B|
    mean_abs_diff: float
    argmax_a: int
    argmax_b: int
    top_k: int
    top_k_overlap: int  # |top-k(A) & top-k(B)|
    correlation: float
    nonfinite_a: int
    nonfinite_b: int
    identical: bool  # byte-for-byte equal

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (a non-finite statistic becomes ``null``)."""
        return {k: (None if isinstance(v, float) and not np.isfinite(v) else v)
                for k, v in asdict(self).items()}

    def lines(self) -> list[str]:
        same = "yes" if self.argmax_a == self.argmax_b else "NO"
        return [
            f"values         : {self.n}" + ("  (byte-identical)" if self.identical else ""),
            f"max |A-B|      : {self.max_abs_diff:.6g}",
            f"max |A-B|/max|B|: {self.max_rel_diff:.6g}",
            f"mean |A-B|     : {self.mean_abs_diff:.6g}",
            f"argmax         : A {self.argmax_a}, B {self.argmax_b} (same: {same})",
            f"top-{self.top_k} overlap : {self.top_k_overlap}/{self.top_k}",
            f"correlation    : {self.correlation:.9f}",
        ] + ([f"non-finite     : A {self.nonfinite_a}, B {self.nonfinite_b}"]
             if self.nonfinite_a or self.nonfinite_b else [])


def read_logits(path: str | Path) -> np.ndarray:
    """A dump as float32 (read-only memory map for large files)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise UsageError(f"{p}: not a regular file")
    except FileNotFoundError:
        raise UsageError(f"{p}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if size == 0 or size % 4:
        raise UsageError(f"{p}: {size} bytes is not a raw float32 logit dump (needs a non-zero "
                         "multiple of 4 bytes)")
    try:
        return np.fromfile(p, dtype="<f4")
    except OSError as exc:
        raise UsageError(f"{p}: cannot read: {exc.strerror or exc}") from None


def compare_logits(a: np.ndarray, b: np.ndarray, top_k: int = 10) -> LogitComparison:
    if a.shape != b.shape:
        raise UsageError(f"the dumps differ in size: {a.size} vs {b.size} float32 values; "
                         "they are not logits of the same model")
    if a.size == 0:
        raise UsageError("the dumps are empty")
    if top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {top_k}")
    k = min(top_k, a.size)
    fa, fb = np.isfinite(a), np.isfinite(b)
    both = fa & fb
    x, y = a[both].astype(np.float64), b[both].astype(np.float64)
    diff = np.abs(x - y)
    max_b = float(np.max(np.abs(y))) if y.size else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    return LogitComparison(
        n=int(a.size),
        max_abs_diff=max_abs,
        max_rel_diff=max_abs / max_b if max_b > 0 else (0.0 if max_abs == 0 else float("inf")),
        mean_abs_diff=float(diff.mean()) if diff.size else 0.0,
        argmax_a=_argmax(a),
        argmax_b=_argmax(b),
        top_k=k,
        top_k_overlap=len(set(_top(a, k)) & set(_top(b, k))),
        correlation=_corr(x, y),
        nonfinite_a=int((~fa).sum()),
        nonfinite_b=int((~fb).sum()),
        identical=a.tobytes() == b.tobytes(),
    )


def _argmax(v: np.ndarray) -> int:
    """Largest finite value, ties to the lowest index (the engine's greedy rule)."""
    w = np.where(np.isfinite(v), v, -np.inf)
    return int(np.argmax(w))


def _top(v: np.ndarray, k: int) -> list[int]:
    w = np.where(np.isfinite(v), v.astype(np.float64), -np.inf)
    return [int(i) for i in np.argsort(-w, kind="stable")[:k]]


def _corr(x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 2:
        return 1.0 if np.array_equal(x, y) else 0.0
    xc, yc = x - x.mean(), y - y.mean()
    den = float(np.sqrt((xc * xc).sum() * (yc * yc).sum()))
    if den == 0:
        return 1.0 if np.array_equal(x, y) else 0.0
    return float((xc * yc).sum() / den)


def read_pair(a: str | Path, b: str | Path) -> tuple[np.ndarray, np.ndarray]:
    xa, xb = read_logits(a), read_logits(b)
    if xa.size != xb.size:
        raise UsageError(f"{a} holds {xa.size} float32 values and {b} holds {xb.size}; "
                         "refusing to compare dumps of different sizes")
    return xa, xb


def compare_files(a: str | Path, b: str | Path, top_k: int = 10) -> LogitComparison:
    return compare_logits(*read_pair(a, b), top_k)


def check_tolerances(atol: float | None, rtol: float | None) -> None:
    for flag, v in (("--atol", atol), ("--rtol", rtol)):
        if v is not None and not (np.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} must be a finite number >= 0, got {v}")


def disagreements(a: np.ndarray, b: np.ndarray, res: LogitComparison,
                  atol: float | None = None, rtol: float | None = None) -> list[str]:
    """Why A and B do not agree (empty: they do): argmax, then the tolerances if given."""
    check_tolerances(atol, rtol)
    out = []
    if res.argmax_a != res.argmax_b:
        out.append(f"argmax differs (A {res.argmax_a}, B {res.argmax_b})")
    if atol is None and rtol is None:
        return out
    at, rt = atol or 0.0, rtol or 0.0
    x, y = a.astype(np.float64), b.astype(np.float64)
    close = np.isclose(x, y, rtol=rt, atol=at, equal_nan=True)
    close |= (x == y)  # the same infinity
    bad = int((~close).sum())
    if bad:
        with np.errstate(invalid="ignore"):
            excess = np.where(close, -np.inf, np.abs(x - y) - (at + rt * np.abs(y)))
        worst = int(np.argmax(np.where(np.isnan(excess), np.inf, excess)))
        out.append(f"{bad} of {a.size} values fail |A-B| <= {at:g} + {rt:g}*|B| (worst at "
                   f"index {worst}: A {float(a[worst]):.9g}, B {float(b[worst]):.9g})")
    return out
