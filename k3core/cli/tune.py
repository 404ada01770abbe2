"""``k3 tune MODEL_DIR [--trunk DIR]``: pick threads, backend, expert readers and the router
lookahead on this machine, keep only settings whose ids match ``--backend numpy`` and that win
beyond the noise of repeated runs, and write them as a user preset with budgets sized to the
model and this machine (``k3core.tools.tune``, docs/presets.md). The timings go to stderr
(and into ``--json``); stdout gets the result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from k3core.api.errors import UsageError
from k3core.cli.guard import guarded
from k3core.cli.options import EngineFlags, engine_flags
from k3core.cli.progress import Progress

_KEPT = "kept in the preset"
#: the engine flags k3 tune takes, and what each means here
NOTES = {
    "trunk_gb": f"{_KEPT} (default: sized to the model and the memory available; never more "
                "than the model can use)",
    "cache_gb": f"{_KEPT} (default: sized like --trunk-gb)",
    "storage": _KEPT,
    "backend": "a candidate to try, repeatable (default: every available one)",
    "threads": "a candidate to try, repeatable (default 1, 2, 4, ... up to the CPU count)",
    "expert_readers": "a candidate to try, repeatable (default 1, 2, 4, 8)",
    "lookahead": "a candidate to try, repeatable (default off, on)",
}


@guarded
@engine_flags(only=("trunk", "trunk_gb", "cache_gb", "storage", "backend", "threads",
                    "expert_readers", "lookahead"),
              repeatable=("backend", "threads", "expert_readers", "lookahead"), notes=NOTES,
              after="model_dir")
def tune(
    model_dir: Path = typer.Argument(..., help="Directory with the safetensors shards."),
    spec: list[str] = typer.Option([], "--spec", help="A speculative decoding mode to try (repeatable; default off, ngram)."),
    spec_width: list[int] = typer.Option([], "--spec-width", help="A draft width to try once spec is on (repeatable; default 2, 4, 8)."),
    name: str = typer.Option("tuned", "--name", help="The preset to write (a user preset: k3 presets show NAME)."),
    ids: str = typer.Option(None, "--ids", help="Prompt token ids for every timed run (default 3,7,11,5,9)."),
    gen: int = typer.Option(6, "--gen", help="Tokens each run decodes (2..64; the first step also prefills)."),
    repeat: int = typer.Option(3, "--repeat", help="Timed runs per option, alternating (2..20); a candidate is kept only when its worst run beats the baseline's best."),
    force: bool = typer.Option(False, "--force", help="Replace a preset of that name."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no timing table on stderr (--json still has the timings)."),
    *,
    flags: EngineFlags,
) -> None:
    """Time short decodes per candidate setting; write what wins beyond noise with the reference's ids."""
    from k3core.run.prompt import parse_ids
    from k3core.tools.tune import DEFAULT_IDS, TuneOptions, check_engine_values
    from k3core.tools.tune import tune as run_tune

    check_engine_values(flags.given)
    if not 2 <= gen <= 64:
        raise UsageError(f"--gen must be in 2..64, got {gen}")
    bad = [v for v in spec if v not in ("off", "ngram", "auto")]
    if bad:
        raise UsageError(f"--spec must be off, ngram or auto, got {bad[0]!r}")
    if any(not 1 <= w <= 16 for w in spec_width):
        raise UsageError("--spec-width must be in 1..16")
    prompt = parse_ids(ids) if ids is not None else list(DEFAULT_IDS)
    given = flags.given
    opts = TuneOptions(model_dir=model_dir, trunk=given["trunk"], trunk_gb=given["trunk_gb"],
                       cache_gb=given["cache_gb"], storage=given["storage"],
                       backends=given["backend"], threads=given["threads"],
                       expert_readers=given["expert_readers"], lookahead=given["lookahead"],
                       spec=spec, spec_width=spec_width, name=name, ids=prompt, gen=gen,
                       repeat=repeat, force=force)
    with Progress("tune", unit="run", quiet=quiet) as bar:
        result = run_tune(opts, progress=lambda s: bar.note(f"tune: {s}"),
                          on_run=lambda done, planned: bar.update(done, planned))
    if not quiet:
        for line in result.table_lines():
            print(line, file=sys.stderr)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    for line in result.summary_lines():
        print(line)


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)
