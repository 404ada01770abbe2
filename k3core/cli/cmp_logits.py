"""``k3 cmp-logits A B``: how far apart two raw float32 logit dumps are.

Exit 0 when the dumps agree: the same argmax and, with ``--atol``/``--rtol``, every value
within ``atol + rtol * |B|``. Exit 1 (after the statistics) when they do not, with one
``k3: error: the dumps disagree: ...`` line; exit 2 for a dump that cannot be read, or
dumps whose sizes differ (refused from the sizes, before either is read). The dumps are
read a chunk at a time, so memory stays small whatever their size.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from k3core.api.errors import K3Error, UsageError
from k3core.cli.guard import guarded
from k3core.tools.logit_compare import check_tolerances, compare_pair, pair_disagreements
from k3core.tools.logit_dumps import DumpPair


@guarded
def cmp_logits(
    a: Path = typer.Argument(..., help="First dump (raw little-endian float32)."),
    b: Path = typer.Argument(..., help="Second dump; relative differences are against it."),
    top_k: int = typer.Option(10, "--top-k", help="Compare the K largest logits of each."),
    atol: float = typer.Option(None, "--atol", help="Fail unless every |A-B| <= atol + rtol*|B|."),
    rtol: float = typer.Option(None, "--rtol", help="Relative tolerance for the same test."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Compare two logit dumps; exit 1 when the argmax differs or a tolerance fails."""
    check_tolerances(atol, rtol)
    if top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {top_k}")
    with DumpPair.open(a, b) as pair:  # sizes checked before either file is read
        res = compare_pair(pair, top_k)
        problems = pair_disagreements(pair, res, atol, rtol)
    if as_json:
        doc = {**res.to_json(), "atol": atol, "rtol": rtol, "agree": not problems,
               "problems": problems}
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        print(f"A: {a}\nB: {b}")
        for line in res.lines():
            print(line)
        if atol is not None or rtol is not None:
            print(f"tolerance      : atol {atol or 0:g}, rtol {rtol or 0:g}: "
                  + ("all values within" if len(problems) == (res.argmax_a != res.argmax_b)
                     else "FAILED"))
    if problems:
        raise K3Error("the dumps disagree: " + "; ".join(problems))


def register(app: typer.Typer) -> None:
    app.command("cmp-logits")(cmp_logits)
