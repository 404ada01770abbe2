"""The run report: banner, memory plan, a live per-step table, and the summary.

Printed with rich so it reads well in a terminal and stays plain text when piped. The
per-step table streams decoded text as tokens arrive, never splitting a UTF-8 character.
Every figure printed here is also in ``--out`` JSON (``RunReport.summary``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from k3core.api.experts import ExpertStats
from k3core.api.units import human


def gb(n: float) -> str:
    """Decimal gigabytes, two decimals (the reference's units: 1 GB = 1e9 B)."""
    return f"{n / 1e9:.2f} GB"


@dataclass
class StepRow:
    step: int
    token: int
    seconds: float
    hit_rate: float | None
    gb_read: float
    text: str = ""


@dataclass
class RunReport:
    console: Console = field(default_factory=lambda: Console(highlight=False, soft_wrap=True))
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))
    rows: list[StepRow] = field(default_factory=list)
    _last: tuple[int, int, int] = (0, 0, 0)

    def line(self, text: str = "") -> None:
        self.console.print(text, markup=False)

    def note(self, text: str) -> None:
        self.console.print(f"note: {text}", markup=False)

    def table(self, title: str, rows: Iterable[tuple[str, str]]) -> None:
        t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        for a, b in rows:
            t.add_row(a, b)
        self.console.print(t)

    # ---- the live per-step table ---------------------------------------------------------------
    def step_header(self) -> None:
        self.line(f"{'STEP':>5} {'TOKEN':>8} {'SECONDS':>9} {'CACHE HIT':>9} {'READ GB':>8} {'TOK/S':>7}  TEXT")

    def step(self, step: int, token: int, seconds: float, stats: ExpertStats | None, text: str = "") -> None:
        hit, read = None, 0.0
        if stats is not None:
            req, hits, nbytes = stats.requests, stats.hits, stats.bytes_read
            dreq, dhit, dbytes = req - self._last[0], hits - self._last[1], nbytes - self._last[2]
            self._last = (req, hits, nbytes)
            hit = dhit / dreq if dreq else None
            read = dbytes / 1e9
        row = StepRow(step, token, seconds, hit, read, text)
        self.rows.append(row)
        hit_s = f"{100 * hit:8.1f}%" if hit is not None else f"{'-':>9}"
        shown = text.replace("\n", "\\n")
        self.line(
            f"{step:>5} {token:>8} {seconds:>9.3f} {hit_s} {read:>8.3f} {1 / max(seconds, 1e-9):>7.2f}  {shown}"
        )
        sys.stdout.flush()

    def reset_step_baseline(self, stats: ExpertStats | None) -> None:
        if stats is not None:
            self._last = (stats.requests, stats.hits, stats.bytes_read)


def cache_summary(stats: ExpertStats, slots: int, slot_bytes: int, policy: str, describe: str) -> list[tuple[str, str]]:
    req = stats.requests
    ret = (req - stats.evictions) / req if req else 0.0
    mbs = stats.bytes_read / stats.read_seconds / 1e6 if stats.read_seconds > 0 else 0.0
    return [
        ("policy", describe if describe.startswith(policy) else f"{policy}: {describe}" if describe else policy),
        ("slots", f"{slots} x {human(slot_bytes)} = {human(slots * slot_bytes)}"),
        ("requests", f"{req}"),
        ("resident hits", f"{stats.hits} ({100 * stats.hits / req if req else 0:.1f}%; resident before the step began)"),
        ("misses", f"{stats.misses}  reused this step: {int(stats.extra.get('reuse', 0))}"),
        ("evictions", f"{stats.evictions}  retention {100 * ret:.1f}%"),
        ("read", f"{human(stats.bytes_read)} in {stats.read_seconds:.2f} s device time ({mbs:.0f} MB/s)"),
        ("waiting on reads", f"{stats.exposed_wait_seconds:.2f} s exposed (the rest overlapped compute)"),
        ("drops", f"{stats.drops}"),
    ]


def cache_json(stats: ExpertStats) -> dict[str, Any]:
    return {
        "expert_requests": stats.requests,
        "expert_resident_hits": stats.hits,
        "expert_misses": stats.misses,
        "expert_reuse_in_step": int(stats.extra.get("reuse", 0)),
        "expert_evictions": stats.evictions,
        "expert_bytes_read": stats.bytes_read,
        "expert_read_seconds": stats.read_seconds,
        "expert_exposed_wait_seconds": stats.exposed_wait_seconds,
        "expert_drops": stats.drops,
    }
