"""``k3 backends``: every registered plugin of every kind, its status and where it comes from."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from k3core.cli import guarded
from k3core.registry import KIND_WORDS, get_registry


@guarded
def backends() -> None:
    """List kernel backends, storage backends and cache policies with their status."""
    reg = get_registry()
    console = Console()
    table = Table(title="k3 plugins", show_lines=False)
    for col in ("kind", "name", "priority", "status", "from"):
        table.add_column(col)
    for kind, word in KIND_WORDS.items():
        for name in reg.names(kind):
            entry = reg.entries[kind][name]
            avail = reg.probe(kind, name)
            if entry.conflict_with:
                status = f"[red]conflict[/] with {entry.conflict_with}"
            elif avail.ok:
                status = "[green]available[/]"
            else:
                status = f"[yellow]unavailable[/]: {avail.reason}" + (f" (fix: {avail.hint})" if avail.hint else "")
            table.add_row(word, name, str(entry.spec.priority), status, entry.origin)
    for b in reg.broken:
        table.add_row("plugin", b.name, "-", f"[red]broken[/]: {b.reason}", b.origin)
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("backends")(backends)
