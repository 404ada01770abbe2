"""Compare two raw float32 logit dumps (``k3 run --dump-logits``, the reference's format).

A dump is the little-endian float32 logits of one position, no header. Two dumps must have
the same size, a multiple of 4 bytes, and at least one value; anything else is a
``UsageError`` (exit 2), found from the sizes before either file is read. The files are
then read a chunk at a time (:mod:`k3core.tools.logit_dumps`), so memory stays a few MB
whatever their size. Statistics are computed in float64 over the positions where both
values are finite; non-finite values are counted, never hidden. Every statistic has the
bits the one-pass NumPy formulas give over whole arrays (maxima and counts are exact in any
order; the mean and the correlation are summed in NumPy's own pairwise order).

:func:`disagreements` is the verdict ``k3 cmp-logits`` turns into its exit status: the
argmax differs, or (when ``atol``/``rtol`` are given) some value fails
``|A - B| <= atol + rtol * |B|`` (NumPy's ``isclose`` rule; a position where A and B are not
both finite fails unless both hold the same non-finite value).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from k3core.api.errors import UsageError
from k3core.tools.logit_dumps import DumpPair, FiniteView, streamed_sum


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


def compare_logits(a: np.ndarray, b: np.ndarray, top_k: int = 10) -> LogitComparison:
    """Compare two in-memory dumps (see :func:`compare_pair`)."""
    return compare_pair(DumpPair.of(a, b), top_k)


def compare_pair(pair: DumpPair, top_k: int = 10) -> LogitComparison:
    """The statistics of :class:`LogitComparison`, a chunk of each dump at a time: one pass
    for the counts, the argmax and the top-k, then :class:`_FiniteStats`' two."""
    if pair.n == 0:
        raise UsageError("the dumps are empty")
    if top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {top_k}")
    k = min(top_k, pair.n)
    counts: list[int] = []
    nonfinite_a = nonfinite_b = 0
    identical = True
    best_a, best_b = _Best(), _Best()
    top_a, top_b = _Top(k), _Top(k)
    for lo, a, b in pair.chunks():
        fa, fb = np.isfinite(a), np.isfinite(b)
        counts.append(int((fa & fb).sum()))
        nonfinite_a += int(a.size - fa.sum())
        nonfinite_b += int(b.size - fb.sum())
        identical = identical and a.tobytes() == b.tobytes()
        wa = a if fa.all() else np.where(fa, a, np.float32(-np.inf))  # float32: the order of
        wb = b if fb.all() else np.where(fb, b, np.float32(-np.inf))  # the float64 values
        best_a.add(lo, wa)
        best_b.add(lo, wb)
        top_a.add(lo, wa)
        top_b.add(lo, wb)
    st = _FiniteStats(FiniteView(pair, counts), pair.chunk)
    return LogitComparison(
        n=pair.n,
        max_abs_diff=st.max_abs,
        max_rel_diff=(st.max_abs / st.max_b if st.max_b > 0
                      else (0.0 if st.max_abs == 0 else float("inf"))),
        mean_abs_diff=st.mean_abs,
        argmax_a=best_a.index,
        argmax_b=best_b.index,
        top_k=k,
        top_k_overlap=len(set(top_a.ids()) & set(top_b.ids())),
        correlation=st.correlation,
        nonfinite_a=nonfinite_a,
        nonfinite_b=nonfinite_b,
        identical=identical,
    )


class _FiniteStats:
    """Over the positions where A and B are both finite (``x = a[both]``, ``y = b[both]``
    as float64): ``max |x - y|``, ``max |y|``, ``mean |x - y|`` and the correlation
    ``sum(xc * yc) / sqrt(sum(xc * xc) * sum(yc * yc))`` (``xc = x - mean x``), summed in
    NumPy's pairwise order in two passes: the plain sums, then the centred products."""

    def __init__(self, view: FiniteView, leaf: int):
        self.view = view
        self.max_abs = self.max_b = 0.0
        self.equal = True  # x == y everywhere: the correlation of a constant pair
        m = view.m
        self.mean_abs, self.correlation = 0.0, 1.0
        if m == 0:
            return
        sum_diff, sum_x, sum_y = streamed_sum(m, self._plain, leaf)
        self.mean_abs = sum_diff / m
        if m < 2:
            self.correlation = 1.0 if self.equal else 0.0
            return
        self.mx, self.my = sum_x / m, sum_y / m
        sxx, syy, sxy = streamed_sum(m, self._centred, leaf)
        den = math.sqrt(sxx * syy)
        self.correlation = sxy / den if den != 0 else (1.0 if self.equal else 0.0)

    def _plain(self, lo: int, hi: int) -> tuple[float, ...]:
        x, y = self.view.range(lo, hi)
        diff = np.abs(x - y)
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_b = max(self.max_b, float(np.abs(y).max()))
        self.equal = self.equal and bool(np.array_equal(x, y))
        return np.sum(diff), np.sum(x), np.sum(y)

    def _centred(self, lo: int, hi: int) -> tuple[float, ...]:
        x, y = self.view.range(lo, hi)
        xc, yc = x - self.mx, y - self.my
        return np.sum(xc * xc), np.sum(yc * yc), np.sum(xc * yc)


class _Best:
    """The largest value seen so far, ties to the lowest index (the engine's greedy rule);
    non-finite values count as -inf. Index 0 when nothing is finite, as ``np.argmax``."""

    def __init__(self) -> None:
        self.value = -np.inf
        self.index = 0
        self.seen = False

    def add(self, lo: int, w: np.ndarray) -> None:
        i = int(np.argmax(w))
        if not self.seen or w[i] > self.value:
            self.value, self.index, self.seen = float(w[i]), lo + i, True


class _Top:
    """The ``k`` largest values seen so far in ``np.argsort(-w, kind="stable")`` order
    (largest first, ties to the lowest index), kept as at most ``k`` candidates."""

    def __init__(self, k: int):
        self.k = k
        self.values = np.empty(0, np.float32)
        self.index = np.empty(0, np.int64)

    def add(self, lo: int, w: np.ndarray) -> None:
        if self.index.size == self.k:  # only a value above the k-th kept one can enter (an
            pick = np.flatnonzero(w > self.values[-1])  # equal one comes later: it loses)
            if pick.size == 0:
                return
        else:
            pick = np.arange(w.size)
        if pick.size > self.k:  # the k-th largest value, then every value above it and enough
            v = w[pick]  # of those equal to it, lowest index first
            cut = np.partition(v, v.size - self.k)[v.size - self.k]
            keep = pick[v > cut]
            ties = pick[v == cut][: self.k - keep.size]
            pick = np.sort(np.concatenate([keep, ties]))
        values = np.concatenate([self.values, w[pick]])  # index order: earlier chunks first
        index = np.concatenate([self.index, pick + lo])
        order = np.argsort(-values, kind="stable")[: self.k]
        self.values, self.index = values[order], index[order]

    def ids(self) -> list[int]:
        return [int(i) for i in self.index]


def check_tolerances(atol: float | None, rtol: float | None) -> None:
    for flag, v in (("--atol", atol), ("--rtol", rtol)):
        if v is not None and not (np.isfinite(v) and v >= 0):
            raise UsageError(f"{flag} must be a finite number >= 0, got {v}")


def disagreements(a: np.ndarray, b: np.ndarray, res: LogitComparison,
                  atol: float | None = None, rtol: float | None = None) -> list[str]:
    """:func:`pair_disagreements` of two in-memory dumps."""
    return pair_disagreements(DumpPair.of(a, b), res, atol, rtol)


def pair_disagreements(pair: DumpPair, res: LogitComparison, atol: float | None = None,
                       rtol: float | None = None) -> list[str]:
    """Why A and B do not agree (empty: they do): argmax, then the tolerances if given."""
    check_tolerances(atol, rtol)
    out = []
    if res.argmax_a != res.argmax_b:
        out.append(f"argmax differs (A {res.argmax_a}, B {res.argmax_b})")
    if atol is None and rtol is None:
        return out
    at, rt = atol or 0.0, rtol or 0.0
    bad = 0
    worst = (-np.inf, -1, 0.0, 0.0)  # (excess, index, A, B): the first largest excess
    for lo, a, b in pair.chunks():
        x, y = a.astype(np.float64), b.astype(np.float64)
        close = np.isclose(x, y, rtol=rt, atol=at, equal_nan=True)
        close |= (x == y)  # the same infinity
        n_bad = int((~close).sum())
        if not n_bad:
            continue
        bad += n_bad
        with np.errstate(invalid="ignore", over="ignore"):
            excess = np.where(close, -np.inf, np.abs(x - y) - (at + rt * np.abs(y)))
        excess = np.where(np.isnan(excess), np.inf, excess)
        i = int(np.argmax(excess))
        if worst[1] < 0 or excess[i] > worst[0]:
            worst = (float(excess[i]), lo + i, float(a[i]), float(b[i]))
    if bad:
        out.append(f"{bad} of {pair.n} values fail |A-B| <= {at:g} + {rt:g}*|B| (worst at "
                   f"index {worst[1]}: A {worst[2]:.9g}, B {worst[3]:.9g})")
    return out
