"""Per-op counters of the ``timed`` backend and their table."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class OpStats:
    """Calls, wall seconds and input bytes of one op."""

    calls: int = 0
    seconds: float = 0.0
    bytes_in: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds > 0 else 0.0


class OpTable:
    """Thread-safe accumulation of :class:`OpStats` by op name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: dict[str, OpStats] = {}

    def add(self, op: str, seconds: float, bytes_in: int) -> None:
        with self._lock:
            s = self.ops.setdefault(op, OpStats())
            s.calls += 1
            s.seconds += seconds
            s.bytes_in += bytes_in

    def snapshot(self) -> dict[str, OpStats]:
        with self._lock:
            return {k: OpStats(v.calls, v.seconds, v.bytes_in) for k, v in self.ops.items()}

    def format(self, title: str) -> str:
        """A fixed-width table, slowest op first, with a total line."""
        rows = sorted(self.snapshot().items(), key=lambda kv: -kv[1].seconds)
        total = sum(s.seconds for _, s in rows) or 1.0
        lines = [
            title,
            f"{'op':<16}{'calls':>9}{'seconds':>11}{'share':>8}{'MB in':>11}{'GB/s':>8}",
        ]
        for name, s in rows:
            lines.append(
                f"{name:<16}{s.calls:>9}{s.seconds:>11.4f}{100 * s.seconds / total:>7.1f}%"
                f"{s.bytes_in / 1e6:>11.2f}{s.gb_per_s:>8.2f}"
            )
        lines.append(f"{'total':<16}{sum(s.calls for _, s in rows):>9}{total:>11.4f}")
        return "\n".join(lines)
