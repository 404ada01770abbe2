"""Turning ``--trunk``, ``--trunk-gb``, ``--trunk-ring`` and ``--ultra-low-memory`` into parts.

The engine request calls :func:`check_trunk_options` before anything large happens, and the
binding :func:`open_streamed_trunk` when a packed trunk was given (without one the trunk stays
resident, as before). Budgets are decimal GB (1 GB = 10^9 bytes); without ``--trunk-gb``
every layer is pinned (read once from ``trunk.bin``, nothing streams).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from k3core.api.errors import UsageError, param
from k3core.api.storage import StorageBackend
from k3core.api.units import check_gb, human
from k3core.checkpoint.index import CheckpointIndex
from k3core.model.config import ModelConfig
from k3core.model.sources import ModelTables
from k3core.trunk.manifest import open_trunk
from k3core.trunk.plan import DEFAULT_RING, MAX_RING, plan_lines
from k3core.trunk.stream import StreamedTrunk
from k3core.trunk.tables import StreamedTables


def check_trunk_options(trunk_dir: Path | None, trunk_gb: float | None, ring: int | None,
                        ultra_low_memory: bool, incremental: bool | None = None) -> None:
    """Refuse impossible values and combinations with ``UsageError`` (exit 2)."""
    check_gb(trunk_gb, param("trunk_gb"), positive=True)
    if trunk_dir is None:
        for name, value in (("trunk_gb", trunk_gb), ("trunk_ring", ring)):
            if value is not None:
                raise UsageError(f"{param(name)} needs {param('trunk')} DIR (a packed trunk to "
                                 "stream from)")
        if ultra_low_memory:
            raise UsageError(f"{param('ultra_low_memory')} needs {param('trunk')} DIR (pack one "
                             "with `k3 pack-trunk MODEL_DIR TRUNK_DIR`)")
    if ring is not None and not 1 <= ring <= MAX_RING:
        raise UsageError(f"{param('trunk_ring')} must be in 1..{MAX_RING}, got {ring}")


def open_streamed_trunk(
    trunk_dir: Path,
    cfg: ModelConfig,
    index: CheckpointIndex,
    storage: StorageBackend,
    n_layers: int,
    trunk_gb: float | None,
    ring: int | None,
    *,
    storage_name: str = "",
    verify: bool = False,
    progress: Callable[[int], None] | None = None,
) -> tuple[StreamedTrunk, list[str]]:
    """Check the packed trunk and open it; returns the trunk and its banner lines."""
    t0 = time.perf_counter()
    man = open_trunk(trunk_dir, index, cfg, n_layers, verify=verify, storage=storage)
    walked = sum(man.layers[L].nbytes for L in range(n_layers))
    budget = walked if trunk_gb is None else int(trunk_gb * 1e9)
    pinned_cb = None
    if progress is not None:
        pinned_cb = lambda done, total: progress(done - 1)  # noqa: E731
    trunk = StreamedTrunk(cfg, man, storage, budget, n_layers, ring or DEFAULT_RING,
                          progress=pinned_cb, verify_every=verify, split=True)
    lines = [f"trunk on disk : {human(man.total_bytes)} total (STREAMED from {trunk_dir}, "
             "not held in RAM)"]
    if trunk_gb is None:
        lines.append("note: no --trunk-gb, so every layer is pinned (read once from trunk.bin)")
    lines += plan_lines(trunk.plan, walked, n_layers, trunk.unit_labels)
    if trunk.has_reader:
        mode = ("an I/O thread reads ahead, the reader thread decodes" if man.compressed
                else "reader thread reads ahead")
    else:
        mode = "read on demand" if trunk.plan.ring else "nothing streams"
    how = (f"{man.codec}-coded windows read in 4096-aligned chunks and decoded into the slot"
           if man.compressed else "one 4096-aligned read per part")
    lines.append(f"read mode     : storage '{storage_name or storage.name}', {how}, "
                 f"{mode}; " + ("whole file checksummed at open, every read "
                                                "checked" if verify else
                                                "each layer checked before first use"))
    lines.append(f"trunk streaming enabled from {trunk_dir} in {time.perf_counter() - t0:.2f} s")
    return trunk, lines


def ultra_lines(tables: object, incremental: bool, n_layers: int) -> list[str]:
    """Banner lines for ``--ultra-low-memory`` (docs/engine-behaviours.md §3, items 7 and 9)."""
    if not isinstance(tables, StreamedTables):
        return []
    lines = [f"final norms: {human(3 * 4 * tables.cfg.hidden)} resident; embedding and "
             f"lm_head STREAMED (lm_head in chunks of {tables.rows_per_chunk} rows)"]
    if incremental:
        lines.append(f"recurrent state: one slot per KDA layer ({n_layers} layers walk): "
                     "incremental decoding carries every layer's state")
    else:
        lines.append(f"recurrent state: one slot, cleared and reused across {n_layers} layers")
    return lines


def report_lines(trunk: object, tables: object) -> list[str]:
    """The end-of-run trunk report (docs/engine-behaviours.md §3) and the streamed-tables line."""
    out: list[str] = []
    if isinstance(trunk, StreamedTrunk):
        out += trunk.stats.report_lines()
    if isinstance(tables, StreamedTables):
        out.append(tables.stats.report_line())
    return out


def report_json(trunk: object, tables: object) -> dict[str, object]:
    """``--out`` fields: trunk counters and plan, model-table bytes, ultra flag."""
    out: dict[str, object] = {"trunk_bytes_read": 0, "embedding_bytes_read": 0,
                              "lm_head_bytes_read": 0,
                              "ultra_low_memory": isinstance(tables, StreamedTables)}
    if isinstance(trunk, StreamedTrunk):
        out.update(trunk.stats.to_json())
        plan = trunk.plan
        out["trunk_plan"] = {"budget_bytes": plan.budget_bytes, "planned_bytes": plan.planned_bytes,
                             "pinned": list(plan.pinned), "ring": plan.ring,
                             "slot_bytes": plan.slot_bytes,
                             "slot_sizes": list(plan.slot_sizes),
                             "requested_ring": plan.requested_ring,
                             "units": trunk.unit_labels,  # "3.attn", "3.mlp" (or "3": whole)
                             "unit_bytes": list(plan.sizes),
                             "pinned_units": [trunk.unit_labels[i] for i in plan.pinned]}
    if isinstance(tables, StreamedTables):
        out.update(tables.stats.to_json())
    if isinstance(tables, ModelTables):
        out["tables_resident_bytes"] = tables.resident_bytes
    elif isinstance(tables, ModelTables):
        out["tables_resident_bytes"] = tables.resident_bytes
    return out


class StepTrunkLog:
    """Per-step trunk figures (bytes, read seconds, exposed wait) for ``--out``: the ladder
    uses them to compare steady-state steps with their own read and compute time."""

    def __init__(self, trunk: object):
        self.trunk = trunk if isinstance(trunk, StreamedTrunk) else None
        self.steps: list[dict[str, float]] = []
        self._last = (0, 0.0, 0.0)

    def record(self) -> None:
        if self.trunk is None:
            return
        st = self.trunk.stats
        now = (st.bytes_read, st.read_seconds, st.exposed_wait_seconds)
        self.steps.append({"bytes": now[0] - self._last[0], "read_seconds": now[1] - self._last[1],
                           "wait_seconds": now[2] - self._last[2]})
        self._last = now

    def to_json(self) -> dict[str, object]:
        return {"step_trunk": self.steps} if self.trunk is not None else {}
