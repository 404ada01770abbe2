"""Which node of the cluster each expert worker runs on.

A cluster names its workers' nodes with custom resources: a node started with ``ray start
--resources '{"k3_worker_0": 1}'`` is worker 0's. When any alive node offers a
``k3_worker_<i>`` resource, every worker of the run must find its own (worker i asks for
one unit of ``k3_worker_<i>``, so Ray places it there and nowhere else); a worker whose
resource no node offers is refused before any actor starts (exit 2), rather than left
pending. Otherwise the workers are spread one per node over the alive nodes that have a
CPU, in a fixed order (node address, then id), worker i on node ``i mod nodes``.

The placement is pure bookkeeping over ``ray.nodes()`` records; :mod:`k3core.cluster.pool`
turns it into Ray scheduling options and prints :meth:`Placement.line` per worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from k3core.api.errors import UsageError

RESOURCE = "k3_worker_{}"
_RESOURCE_RE = re.compile(r"^k3_worker_(\d+)$")


def resource_name(worker: int) -> str:
    return RESOURCE.format(worker)


@dataclass(frozen=True)
class Node:
    """One alive node: its Ray id, its address and what it offers."""

    node_id: str
    address: str
    resources: dict[str, float]

    @property
    def short(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"

    def workers_named(self) -> list[int]:
        """The worker numbers whose ``k3_worker_<i>`` resource this node offers (at least 1)."""
        out = []
        for k, v in self.resources.items():
            m = _RESOURCE_RE.match(k)
            if m and v >= 1:
                out.append(int(m.group(1)))
        return sorted(out)


@dataclass(frozen=True)
class Placement:
    """Where worker ``worker`` runs: by its resource, or on a node id (spread)."""

    worker: int
    node: Node
    resource: str | None  # ``k3_worker_<i>``, or None when spread by node
    of_nodes: int

    def line(self) -> str:
        why = (f"which offers {self.resource}" if self.resource is not None else
               f"spread one per node over {self.of_nodes} node(s)")
        return f"  expert worker {self.worker} -> node {self.node.short}, {why}"


def alive_nodes(records: list[dict[str, Any]]) -> list[Node]:
    """The alive nodes of ``ray.nodes()``, in a fixed order (address, then id)."""
    out = [Node(str(r.get("NodeID", "")), str(r.get("NodeManagerAddress", "?")),
                {str(k): float(v) for k, v in (r.get("Resources") or {}).items()})
           for r in records if r.get("Alive")]
    return sorted(out, key=lambda n: (n.address, n.node_id))


def named_workers(nodes: list[Node]) -> dict[int, Node]:
    """Worker number -> the (first) node offering its ``k3_worker_<i>`` resource."""
    out: dict[int, Node] = {}
    for node in nodes:
        for w in node.workers_named():
            out.setdefault(w, node)
    return out


def default_workers(nodes: list[Node]) -> int:
    """The worker count when none is given: one per named resource, else one per node with
    a CPU (at least one)."""
    named = named_workers(nodes)
    if named:
        return len(named)
    return max(1, sum(1 for n in nodes if n.resources.get("CPU", 0) >= 1))


def place(nodes: list[Node], workers: int, where: str = "the cluster") -> list[Placement]:
    """The node of each of ``workers`` workers (see the module docstring)."""
    if not nodes:
        raise UsageError(f"{where} has no alive node to start expert workers on")
    named = named_workers(nodes)
    if named:
        missing = [w for w in range(workers) if w not in named]
        if missing:
            offered = ", ".join(f"{resource_name(w)} on {n.short}" for w, n in sorted(named.items()))
            m = missing[0]
            raise UsageError(
                f"{where} names its expert workers' nodes ({offered}) but no node offers "
                f"{resource_name(m)} for worker {m}"
                + (f" (nor for workers {', '.join(map(str, missing[1:]))})" if missing[1:] else ""),
                hint=f"start worker {m}'s node with `ray start --address HEAD:PORT --resources "
                     f"'{{\"{resource_name(m)}\": 1}}'`, or run fewer --expert-workers")
        return [Placement(w, named[w], resource_name(w), len(nodes)) for w in range(workers)]
    cpu = [n for n in nodes if n.resources.get("CPU", 0) >= 1]
    if not cpu:
        raise UsageError(f"{where} has no node with a CPU for an expert worker")
    return [Placement(w, cpu[w % len(cpu)], None, len(cpu)) for w in range(workers)]
