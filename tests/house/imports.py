"""The import graph of k3core, read from the source with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "k3core"

# a room may import its own modules and those of lower rank, never a higher or equal rank
RANK = {
    "api": 0,
    "plugins": 1, "model": 1, "tokenizer": 1,
    "checkpoint": 2, "constrain": 2,
    "trunk": 3, "experts": 3,
    "run": 4,
    "serve": 5, "tools": 5, "cluster": 5,
    "testing": 6,
    "cli": 7,
}

#: the run room's modules by pipeline stage, lowest first: a module imports modules of its
#: own stage or a lower one, never a higher one (docs/architecture.md draws the same table)
STAGES: dict[str, tuple[str, ...]] = {
    "request": ("request", "settings", "preset", "prompt", "model_dir", "stops", "batch_file"),
    "plan": ("plan", "memory_plan", "arenas", "preset_auto", "presets"),
    "bind": ("binding",),
    "report": ("generation", "report"),
    "session": ("session", "state_file", "prefix_cache", "prefix_spill", "generate"),
    "engine": ("engine", "batch"),
    "runner": ("runner", "batch_runner"),
}
#: ``k3core.run.MODULE`` -> the rank of its stage
STAGE = {f"k3core.run.{m}": rank for rank, mods in enumerate(STAGES.values()) for m in mods}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    lazy: bool  # inside a function (or under TYPE_CHECKING): not run at import time


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(known: dict[str, Path]) -> list[Edge]:
    out: list[Edge] = []
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        lazy_nodes: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lazy_nodes |= {id(n) for n in ast.walk(node)}
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                lazy_nodes |= {id(n) for b in node.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            for t in targets:
                if t.startswith("k3core") and t != mod:
                    while t not in known and "." in t:
                        t = t.rpartition(".")[0]
                    out.append(Edge(mod, t, node.lineno, id(node) in lazy_nodes))
    return out


def room(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
