"""``k3 presets`` (the table), ``k3 presets show NAME``, ``k3 presets validate FILE``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from k3core.api.errors import K3Error
from k3core.cli.guard import guarded
from k3core.run.presets import (
    Preset,
    PresetError,
    file_problems,
    list_presets,
    load_preset,
    table_lines,
)

presets_app = typer.Typer(
    help="List, show and validate memory presets (see docs/presets.md).",
    no_args_is_help=False,
    invoke_without_command=True,
)


@presets_app.callback(invoke_without_command=True)
@guarded
def presets(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the presets as one JSON object."),
) -> None:
    """Print the preset table: trunk / expert-cache budgets in GB and a note for each."""
    if ctx.invoked_subcommand is not None:
        return
    problems: list[K3Error] = []
    rows = list_presets(on_error=problems.append)
    if as_json:
        doc = {"presets": [{**p.model_dump(), "origin": p.origin, "needs_trunk": p.needs_trunk}
                           for p in rows],
               "auto": "computed from the memory available now (k3 presets show auto); "
                       "runs without --trunk",
               "skipped": [str(exc) for exc in problems]}
        print(json.dumps(doc, indent=2))
    else:
        for line in table_lines(rows):
            print(line)
    for exc in problems:
        print(f"k3: warning: skipped a user preset: {exc}", file=sys.stderr)


def _describe(p: Preset) -> list[str]:
    lines = [f"{key}: {value}" for key, value in p.model_dump().items()
             if value is not None and value != ""]
    lines.append(f"# from: {p.origin}")
    return lines


@presets_app.command("show")
@guarded
def show(
    name: str = typer.Argument(..., help="A preset name (see `k3 presets`), `auto`, or a path."),
    model: Path = typer.Option(None, "--model", help="Plan `auto` for this model directory "
                               "(default: Kimi K3's planned sizes)."),
) -> None:
    """Print one preset's settings and where it was read from."""
    cfg = None
    if model is not None:
        from k3core.model.config import load_config

        cfg = load_config(model)
    for line in _describe(load_preset(name, cfg=cfg)):
        print(line)


@presets_app.command("validate")
@guarded
def validate(file: Path = typer.Argument(..., help="A preset YAML file.")) -> None:
    """Check a preset file as --preset would: exit 0 when usable, 2 with every problem named."""
    preset, problems = file_problems(file)
    if problems or preset is None:
        raise PresetError(f"{file}: " + "; ".join(problems))
    print(f"{file}: valid preset {preset.name!r} (trunk {preset.trunk_gb:.2f} GB / expert "
          f"cache {preset.cache_gb:.2f} GB" + (", ultra-low-memory" if preset.ultra_low_memory
                                              else "") + ")")


def register(app: typer.Typer) -> None:
    app.add_typer(presets_app, name="presets")
