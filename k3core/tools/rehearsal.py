"""The real-shape rehearsal's table (``make rehearsal``, docs/rehearsal.md).

Reads the ``--out`` reports of ``k3 run`` on the sparse full-shape checkpoint and prints one
row per run: peak RSS against the reference engine's ``laptop`` figure, seconds per token,
and the trunk overlap: how long the trunk reader worked, how much of that hid behind
compute, and how long the forward pass sat waiting in ``acquire`` (exposed). Every figure
comes from the report; nothing is estimated here.

    python -m k3core.tools.rehearsal build/rehearsal/laptop.json [...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from k3core.api.errors import K3Error, UsageError

#: the reference engine's measured peak RSS at ``laptop`` (presets/laptop.yaml notes)
REFERENCE_LAPTOP_RSS = 8.24e9

_HEAD = ("run", "peak RSS", "vs 8.24 GB", "s/token", "trunk read s", "overlapped s",
         "exposed wait s", "compute s", "expert wait s")


def row(name: str, rep: dict[str, Any]) -> tuple[str, ...]:
    """One table row from a run report (``k3 run --out``)."""
    try:
        rss = float(rep["peak_rss_bytes"])
        wall = float(rep["wall_seconds"])
        read = float(rep.get("trunk_read_seconds", 0.0))
        over = float(rep.get("trunk_overlapped_seconds", 0.0))
        exposed = float(rep.get("trunk_exposed_wait_seconds", 0.0))
        experts = float(rep.get("expert_exposed_wait_seconds", 0.0))
        steps = rep["step_seconds"]
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{name}: not a k3 run report ({exc})") from None
    per = wall / len(steps) if steps else 0.0
    return (name, f"{rss / 1e9:.2f} GB", f"{rss / REFERENCE_LAPTOP_RSS:.2f}x", f"{per:.1f}",
            f"{read:.1f}", f"{over:.1f}", f"{exposed:.1f}",
            f"{max(0.0, wall - exposed - experts):.1f}", f"{experts:.1f}")


def table(paths: list[Path]) -> list[str]:
    """Markdown table lines, one row per report."""
    rows = []
    for p in paths:
        try:
            rep = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{p}: cannot read the run report: {exc}") from None
        if not isinstance(rep, dict):
            raise UsageError(f"{p}: not a k3 run report")
        rows.append(row(p.stem, rep))
    out = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("k3: error: give the --out reports of the rehearsal runs", file=sys.stderr)
        return 2
    try:
        print("\n".join(table([Path(a) for a in argv])))
    except K3Error as exc:
        print(f"k3: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
