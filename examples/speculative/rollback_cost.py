"""Rollback of a rejected draft: snapshot + recompute against a snapshot per draft row.

For one KDA layer of each shape, a verify pass with ``width`` drafts costs, beyond the
recurrence itself:

* **recompute** (what k3 ships, ``k3core/model/rollback.py``): one copy of ``S`` after the
  sure row, and on a rejection after ``j`` accepted drafts a recurrence over ``j`` rows from
  that copy (nothing more when every draft is accepted);
* **per-row snapshots**: the recurrence called row by row with a copy of ``S`` after each
  (then a rejection is a copy).

``python examples/speculative/rollback_cost.py [--backend avx2] [--width 4]`` prints
microseconds per pass for each shape, the recompute at its worst (``j = width - 1``) and
at its mean for a given acceptance.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import numpy as np

from k3.plugin import MODEL_SIZES, create


def _time(fn: Any, repeat: int = 20) -> float:
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    return float(np.median(best)) * 1e6


def _rows(kern: Any, x: tuple[np.ndarray, ...], n: int, S: np.ndarray) -> None:
    """The recurrence over the first ``n`` rows from a copy of ``S``."""
    kern.kda_recurrent(*(a[:n] for a in x), S.copy())


def _per_row(kern: Any, x: tuple[np.ndarray, ...], n: int, S: np.ndarray) -> None:
    """The recurrence row by row, a copy of ``S`` kept after each."""
    s = S.copy()
    for t in range(n):
        kern.kda_recurrent(*(a[t : t + 1] for a in x), s)
        s.copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="avx2")
    ap.add_argument("--width", type=int, default=4)
    a = ap.parse_args()
    kern = create("kernel", a.backend)
    k = a.width
    rng = np.random.default_rng(0)
    print(f"backend {a.backend}, width {k}: microseconds per KDA layer and pass")
    print(f"{'shape':>7} {'H x D':>9} {'one call':>9} {'recompute: copy':>16} {'+ worst':>8} "
          f"{'per-row snapshots':>18}")
    for name in ("tiny", "small", "medium", "real"):
        H, D = MODEL_SIZES[name]["kda_num_heads"], MODEL_SIZES[name]["kda_head_dim"]

        def arr(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)

        q, kk, v = arr(k + 1, H, D), arr(k + 1, H, D), arr(k + 1, H, D)
        alpha = np.full((k + 1, H, D), 0.9, dtype=np.float32)
        beta = np.full((k + 1, H), 0.5, dtype=np.float32)
        S = arr(H, D, D)

        x = (q, kk, v, alpha, beta)
        one_call = functools.partial(_rows, kern, x, k + 1, S)
        copy = S.copy
        worst = functools.partial(_rows, kern, x, k - 1, S)
        per_row = functools.partial(_per_row, kern, x, k + 1, S)
        base = _time(copy)
        print(f"{name:>7} {f'{H}x{D}':>9} {_time(one_call) - base:>9.1f} {base:>16.1f} "
              f"{_time(worst) - base:>8.1f} {_time(per_row) - base:>18.1f}")


if __name__ == "__main__":
    main()
