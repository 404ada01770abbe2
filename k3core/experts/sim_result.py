"""What the offline simulator measured (:class:`SimResult`) and its three forms.

``to_json()`` for machines (every ``hit_rate`` a fraction in ``0..1``), :meth:`SimResult.to_text`
and :meth:`SimResult.render` (rich) for people, :func:`plot_result` for a PNG. Produced by
:func:`k3core.experts.simulator.simulate`.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3core.api.errors import UsageError
from k3core.api.outputs import check_writable, write_bytes_atomic

BELADY = "belady"


def size_text(nbytes: float) -> str:
    """Decimal GB with two decimals, or MB below a GB (synthetic models have small experts)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


@dataclass
class SimRow:
    """One cache size: hit rates (fractions) and bytes read per token."""

    slots: int
    cache_gb: float | None
    hit_rate: dict[str, float]
    best_online: str
    bytes_per_token: dict[str, float]
    gap_closed: float | None  # (best online - lru) / (belady - lru), None when no gap

    def to_json(self) -> dict[str, Any]:
        return {
            "slots": self.slots,
            "cache_gb": self.cache_gb,
            "hit_rate": {k: round(v, 6) for k, v in self.hit_rate.items()},
            "best_online": self.best_online,
            "bytes_per_token": {k: round(v, 1) for k, v in self.bytes_per_token.items()},
            "gap_closed": None if self.gap_closed is None else round(self.gap_closed, 4),
        }


@dataclass
class SimResult:
    """Everything :func:`simulate` measured; ``to_json()`` is the machine-readable form."""

    requests: int
    distinct: int
    tokens: int
    requests_per_token: int
    expert_bytes: int
    n_layers: int
    n_experts: int
    hottest: list[tuple[int, int, int]]  # (layer, expert, count), hottest first
    policies: list[str]  # column order; BELADY last
    offline: list[str]  # policies that use future knowledge
    rows: list[SimRow] = field(default_factory=list)
    skipped_slots: list[int] = field(default_factory=list)  # sizes under topk + 1 slots
    seconds: dict[str, float] = field(default_factory=dict)  # replay time per policy
    serve: str = "requests"  # how a visit was replayed (simulator.SERVE_MODES)

    @property
    def pool(self) -> int:
        return self.n_layers * self.n_experts

    @property
    def repeats(self) -> int:
        return self.requests - self.distinct

    @property
    def ceiling(self) -> float:
        """Compulsory-miss ceiling: no policy at any size beats ``1 - distinct/requests``."""
        return 1.0 - self.distinct / self.requests

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "distinct": self.distinct,
            "tokens": self.tokens,
            "requests_per_token": self.requests_per_token,
            "expert_bytes": self.expert_bytes,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "pool": self.pool,
            "distinct_pct_of_pool": round(100.0 * self.distinct / self.pool, 4),
            "gb_per_token_no_cache": round(self.requests_per_token * self.expert_bytes / 1e9, 4),
            "hottest": [{"layer": la, "expert": e, "count": c} for la, e, c in self.hottest],
            "repeats": self.repeats,
            "compulsory_ceiling": round(self.ceiling, 6),
            "gb_all_touched": round(self.distinct * self.expert_bytes / 1e9, 3),
            "gb_pool": round(self.pool * self.expert_bytes / 1e9, 3),
            "policies": self.policies,
            "offline": self.offline,
            "hit_rate_units": "fraction of requests (0..1)",
            "serve": self.serve,
            "rows": [r.to_json() for r in self.rows],
            "skipped_slots": self.skipped_slots,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }

    def header_lines(self) -> list[str]:
        top = ", ".join(f"L{la}/e{e} x{c}" for la, e, c in self.hottest)
        return [
            f"trace: {self.requests:,} requests, {self.distinct:,} distinct experts, "
            f"about {self.tokens} token(s) of {self.requests_per_token:,} requests",
            f"distinct experts touched: {self.distinct:,} of {self.pool:,} "
            f"({100.0 * self.distinct / self.pool:.2f} % of the pool)",
            f"if nothing were cached: "
            f"{size_text(self.requests_per_token * self.expert_bytes)} per token",
            f"hottest experts: {top}",
            f"total reuse: {self.repeats:,} of {self.requests:,} requests are repeats "
            f"({100.0 * self.repeats / self.requests:.1f} %)",
            *(["served as the engine serves a layer visit: each expert once, its repeats in "
               "the visit as hits"] if self.serve == "visits" else []),
        ]

    def footer_lines(self) -> list[str]:
        return [
            f"compulsory misses: {self.distinct:,}, a ceiling of {100 * self.ceiling:.2f} % "
            "hit rate for any policy at any size on this trace",
            f"{BELADY} (and {', '.join(self.offline) or 'no other policy'}) use future "
            "knowledge: ceilings, not achievable online",
            f"holding every touched expert needs {size_text(self.distinct * self.expert_bytes)}; "
            f"the whole pool {size_text(self.pool * self.expert_bytes)}",
        ]

    def table_rows(self) -> tuple[list[str], list[list[str]]]:
        """Column titles and formatted cells (shared by the plain and rich renderers)."""
        titles = ["CACHE", "SLOTS", *[p.upper() for p in self.policies]]
        # bytes per token in GB, or in MB when every figure is under a GB (small models)
        big = any(v >= 1e9 for r in self.rows for v in r.bytes_per_token.values())
        unit, scale = ("GB", 1e9) if big or not self.rows else ("MB", 1e6)
        titles += ["BEST ONLINE", "GAP CLOSED", f"{unit} READ/TOK", f"LRU {unit}/TOK"]
        cells = []
        for r in self.rows:
            lru_b = r.bytes_per_token.get("lru")
            cells.append(
                [
                    "-" if r.cache_gb is None else f"{r.cache_gb:g} GB",
                    str(r.slots),
                    *[f"{100 * r.hit_rate[p]:.2f} %" for p in self.policies],
                    r.best_online,
                    "-" if r.gap_closed is None else f"{100 * r.gap_closed:.1f} %",
                    f"{r.bytes_per_token[r.best_online] / scale:.2f}",
                    "-" if lru_b is None else f"{lru_b / scale:.2f}",
                ]
            )
        return titles, cells

    def to_text(self) -> str:
        """The report as plain fixed-width text."""
        titles, cells = self.table_rows()
        widths = [max(len(t), *(len(c[i]) for c in cells)) for i, t in enumerate(titles)]
        line = "  ".join(t.rjust(w) for t, w in zip(titles, widths, strict=True))
        out = [*self.header_lines(), "", line, "-" * len(line)]
        out += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
        out += ["-" * len(line), *self.footer_lines()]
        return "\n".join(out)

    def render(self, console: Any = None) -> None:
        """Print the report with rich (a plain console when none is given)."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        for line in self.header_lines():
            console.print(line, highlight=False)
        titles, cells = self.table_rows()
        table = Table(show_edge=False, pad_edge=False)
        for t in titles:
            table.add_column(t, justify="left" if t == "BEST ONLINE" else "right")
        for row in cells:
            table.add_row(*row)
        console.print(table)
        for line in self.footer_lines():
            console.print(line, highlight=False)

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Hit rate versus slots per policy (Belady dashed) as a PNG, written atomically."""
        return plot_result(self, path)


def plot_result(result: SimResult, path: str | os.PathLike[str], what: str = "--plot") -> Path:
    """Draw the PNG in memory, then write it as :mod:`k3core.api.outputs` writes any output:
    a regular file atomically, a FIFO or ``/dev/null`` in place (the caller has checked it
    against the command's inputs with :func:`k3core.api.outputs.check_outputs`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "plotting needs matplotlib", hint="pip install 'k3[plot]' (or matplotlib)"
        ) from None
    target = Path(path)
    check_writable(target, what)
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        slots = [r.slots for r in result.rows]
        for name in result.policies:
            ys = [100 * r.hit_rate[name] for r in result.rows]
            style = "--" if name == BELADY else ("-." if name in result.offline else "-")
            ax.plot(slots, ys, style, marker="o", ms=3, label=name)
        ax.axhline(100 * result.ceiling, color="grey", lw=0.8, ls=":", label="compulsory ceiling")
        ax.set_xscale("log")
        ax.set_xlabel("cache slots (experts)")
        ax.set_ylabel("hit rate (%)")
        ax.set_title(f"expert cache replay: {result.requests:,} requests, "
                     f"{result.distinct:,} distinct")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        png = io.BytesIO()
        fig.savefig(png, dpi=110, format="png")
    finally:
        plt.close(fig)
    write_bytes_atomic(target, png.getvalue(), what)
    return target
