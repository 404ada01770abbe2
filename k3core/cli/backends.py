"""``k3 backends``: every registered plugin of every kind, its status and where it comes from."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3core.cli.guard import guarded
from k3core.plugins.registry import KIND_WORDS, get_registry


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
                status = f"[red]conflict[/] with {escape(entry.conflict_with)}"
            elif avail.ok:
                status = "[green]available[/]"
            else:
                status = f"[yellow]unavailable[/]: {escape(avail.reason)}" + (
                    f" (fix: {escape(avail.hint)})" if avail.hint else "")
            table.add_row(word, escape(name), str(entry.spec.priority), status, escape(entry.origin))
    # plugin text is untrusted: escaped so a '[' in it is printed, never read as markup
    for b in reg.broken:
        table.add_row("plugin", escape(b.name), "-", f"[red]broken[/]: {escape(b.reason)}",
                      escape(b.origin))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("backends")(backends)
