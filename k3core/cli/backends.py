"""``k3 backends``: every registered plugin of every kind, its status and where it comes from.

``--check`` also imports every factory (without building anything) and reports each one that
cannot be loaded; ``--json`` prints the same facts as one JSON document. The table is never
cut: piped, it is as wide as its longest line; on a terminal, long cells wrap.

``--check-storage NAME MODEL_DIR [--trunk DIR]`` instead reads every tensor of a checkpoint
(and every layer of a packed trunk) through storage backend NAME and compares it with
``plain`` (:mod:`k3core.tools.storage_check`): the report on stdout, a line per file on
stderr, exit 1 when a byte differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3core.api.errors import UsageError
from k3core.cli.guard import guarded
from k3core.plugins.registry import KIND_WORDS, Registry, get_registry


def _rows(reg: Registry, check: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind, word in KIND_WORDS.items():
        for name in reg.names(kind):
            entry = reg.entries[kind][name]
            avail = reg.probe(kind, name)
            row: dict[str, Any] = {
                "kind": word, "name": name, "priority": entry.spec.priority,
                "description": entry.spec.description if isinstance(entry.spec.description, str)
                else "", "origin": entry.origin,
            }
            if entry.conflict_with:
                row.update(status="conflict", reason=f"also claimed by {entry.conflict_with}")
            elif avail.ok:
                row.update(status="available")
            else:
                row.update(status="unavailable", reason=avail.reason,
                           hint=reg.hint(kind, name, avail.hint))
            if check:
                problem = reg.check_factory(kind, name)
                row["factory"] = entry.spec.factory
                if problem:
                    row.update(status="broken", reason=problem, hint=reg.hint(kind, name))
            rows.append(row)
    for b in reg.broken:
        rows.append({"kind": "plugin", "name": b.name, "priority": None, "description": "",
                     "origin": b.origin, "status": "broken", "reason": b.reason})
    return rows


def _status_cell(row: dict[str, Any]) -> str:
    # plugin text is untrusted: escaped so a '[' in it is printed, never read as markup
    status = row["status"]
    if status == "available":
        return "[green]available[/]"
    colour = "yellow" if status == "unavailable" else "red"
    text = f"[{colour}]{status}[/]: {escape(str(row.get('reason', '')))}"
    if row.get("hint"):
        text += f" (fix: {escape(str(row['hint']))})"
    return text


@guarded
def backends(
    check: bool = typer.Option(
        False, "--check", help="Also import every factory and report each one that fails."),
    as_json: bool = typer.Option(False, "--json", help="Print the list as JSON."),
    check_storage: tuple[str, Path] | None = typer.Option(
        None, "--check-storage", metavar="NAME MODEL_DIR",
        help="Read every tensor of MODEL_DIR through storage backend NAME and compare it with "
             "plain's bytes; exit 1 when one differs."),
    trunk: Path | None = typer.Option(
        None, "--trunk", help="With --check-storage: every layer of this packed trunk too."),
) -> None:
    """List kernel backends, storage backends and cache policies with their status."""
    if check_storage is not None:
        if check:
            raise UsageError("--check and --check-storage are separate checks: give one")
        _check_storage(*check_storage, trunk, as_json)
        return
    if trunk is not None:
        raise UsageError("--trunk goes with --check-storage NAME MODEL_DIR")
    reg = get_registry()
    rows = _rows(reg, check)
    failed = [r for r in rows if r["status"] == "broken"]
    if as_json:
        typer.echo(json.dumps({"plugins": rows}, indent=1))
    else:
        probe = Console()
        console = probe if probe.is_terminal else Console(width=100_000)
        table = Table(title="k3 plugins", show_lines=False)
        for col in ("kind", "name", "priority", "status", "description", "from"):
            table.add_column(col, overflow="fold")
        for r in rows:
            prio = "-" if r["priority"] is None else str(r["priority"])
            table.add_row(r["kind"], escape(r["name"]), prio, _status_cell(r),
                          escape(r["description"]), escape(r["origin"]))
        console.print(table)
        if check:
            console.print(f"{len(failed)} broken" if failed else "every factory imports",
                          markup=False)
    if check and failed:
        raise typer.Exit(1)


def _check_storage(name: str, model_dir: Path, trunk: Path | None, as_json: bool) -> None:
    from k3core.tools.storage_check import check_storage

    result = check_storage(name, model_dir, trunk,
                           progress=lambda line: print(f"k3: {line}", file=sys.stderr))
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        for line in result.lines():
            typer.echo(line)
    if not result.ok:
        raise result.refusal()


def register(app: typer.Typer) -> None:
    app.command("backends")(backends)
