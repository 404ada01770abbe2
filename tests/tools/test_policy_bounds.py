"""tools/policy_bounds.py: the study rules replay a real trace and are scored against the
LRU-to-Belady gap (docs/expert-cache.md, "Routing patterns")."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "experts" / "data" / "demo_batch4_trace.bin.gz"


def test_every_rule_gets_a_share_of_the_gap() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "policy_bounds.py"), str(TRACE),
         "--model", str(ROOT / "demo-model"), "--slots", "16,64"],
        capture_output=True, text=True, check=True, timeout=120).stdout
    rows = {line[:20].strip(): line[20:].split() for line in out.splitlines()[2:]}
    assert set(rows) == {"cycle-eta", "cycle-eta h8", "cycle-eta h64", "cycle-eta s2",
                         "cycle-eta s32", "lfu", "lrfu 0.05", "lrfu 0.2", "lrfu 1",
                         "popularity oracle"}
    for cells in rows.values():
        assert len(cells) == 4 and cells[1] == cells[3] == "%"  # two sizes, both with a gap
    share = {k: int(v[0]) for k, v in rows.items()}
    # knowing the future's counts beats every online rule; none of them is past Belady
    assert share["popularity oracle"] > max(v for k, v in share.items() if k != "popularity oracle")
    assert all(v <= 100 for v in share.values())


def test_visit_counts_count_a_key_once_a_visit() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from policy_bounds import visit_counts
    finally:
        sys.path.pop(0)
    pairs = np.array([[2, 5], [2, 5], [2, 7], [3, 5], [2, 5]], dtype=np.int32)
    assert visit_counts(pairs) == Counter({2 << 20 | 5: 2, 2 << 20 | 7: 1, 3 << 20 | 5: 1})
