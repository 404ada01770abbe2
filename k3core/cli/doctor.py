"""``k3 doctor [MODEL_DIR]``: check the machine (and a model), then print the next command."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from k3core.api.errors import UsageError
from k3core.cli.guard import guarded
from k3core.cli.progress import Stages
from k3core.tools.doctor.machine import DoctorReport, run_doctor

_MARK = {"ok": "[green]  ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]",
         "info": "[dim]info[/]"}


def render(report: DoctorReport, console: Console) -> None:
    section = None
    for c in report.checks:
        if c.section != section:
            section = c.section
            console.print(f"\n[bold]{section}[/]")
        console.print(f"  {_MARK[c.status]}  {escape(c.name)}: {escape(c.detail)}")
    console.print()
    if report.failed:
        fails = sum(c.status == "fail" for c in report.checks)
        console.print(f"[bold red]result: {fails} blocking problem(s)[/]; fix them and run "
                      "k3 doctor again")
    elif report.next_commands:
        console.print("[bold green]result: ready[/]. Next:")
        for cmd in report.next_commands:
            console.print(f"  {escape(cmd)}")
    else:
        warned = (f", [yellow]{report.warnings} warning(s)[/] above" if report.warnings
                  else "")
        which = f"preset {report.preset}" if report.preset else "no preset fits"
        console.print(f"[bold green]result: no blocking problems[/]{warned} ({which}). Give a "
                      "model directory to check it too: k3 doctor MODEL_DIR")
    if report.next_commands and report.warnings:
        console.print(f"[yellow]{report.warnings} warning(s) above[/]")


@guarded
def doctor(
    model_dir: Path = typer.Argument(None, help="A checkpoint directory to check as well."),
    probe_mb: int = typer.Option(256, "--probe-mb", help="MB to read for the disk probe."),
    no_disk_probe: bool = typer.Option(False, "--no-disk-probe", help="Skip the bandwidth probe."),
    storage: str = typer.Option("auto", "--storage", help="Storage backend for reading headers."),
    probe_dir: Path = typer.Option(None, "--probe-dir", help="Where the bandwidth probe writes "
                                   "its scratch file when there is no shard to read "
                                   "(default: the current directory; announced, then removed)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    """Check toolchain, plugins, CPU, memory, disk and (optionally) a model directory."""
    if probe_mb < 1:
        raise UsageError(f"--probe-mb must be >= 1, got {probe_mb}")
    if probe_dir is not None and not probe_dir.is_dir():
        raise UsageError(f"--probe-dir {probe_dir}: not an existing directory")
    units = {"checks": "check", "scratch file": "B", "read tests": "test"}
    with Stages("doctor", quiet=quiet, units=units) as stages:
        report = run_doctor(model_dir, probe_bytes=probe_mb * 1_000_000,
                            disk_probe=not no_disk_probe, storage=storage, probe_dir=probe_dir,
                            progress=lambda msg: stages.note(f"k3 doctor: {msg}"), steps=stages)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        render(report, Console(soft_wrap=True, highlight=False))
    if report.exit_code:
        raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
