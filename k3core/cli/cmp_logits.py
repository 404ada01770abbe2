"""``k3 cmp-logits A B``: how far apart two raw float32 logit dumps are."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from k3core.cli.guard import guarded
from k3core.tools.logit_compare import compare_files


@guarded
def cmp_logits(
    a: Path = typer.Argument(..., help="First dump (raw little-endian float32)."),
    b: Path = typer.Argument(..., help="Second dump; relative differences are against it."),
    top_k: int = typer.Option(10, "--top-k", help="Compare the K largest logits of each."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Compare two logit dumps: max/mean abs diff, relative diff, top-k overlap, argmax."""
    res = compare_files(a, b, top_k)
    if as_json:
        print(json.dumps(res.to_json(), indent=2, allow_nan=False))
        return
    print(f"A: {a}\nB: {b}")
    for line in res.lines():
        print(line)


def register(app: typer.Typer) -> None:
    app.command("cmp-logits")(cmp_logits)
