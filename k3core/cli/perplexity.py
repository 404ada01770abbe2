"""``k3 perplexity MODEL FILE``: mean cross-entropy per token of a text file, in sliding windows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from k3core.api.errors import UsageError
from k3core.cli.guard import guarded
from k3core.cli.options import EngineFlags, engine_flags
from k3core.cli.progress import Progress
from k3core.run.engine import open_engine
from k3core.run.plan import EnginePlan
from k3core.run.prompt import MAX_PROMPT_FILE
from k3core.tools.perplexity import check_window, perplexity


def read_text_file(path: Path) -> bytes:
    """The file's bytes (a regular file up to the prompt-file limit), else exit 2."""
    try:
        if not path.is_file():
            raise UsageError(f"{path}: no such file" if not path.exists() else
                             f"{path}: not a regular file")
        size = path.stat().st_size
        if size > MAX_PROMPT_FILE:
            raise UsageError(f"{path}: {size} bytes is over the {MAX_PROMPT_FILE}-byte limit")
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None


@guarded
@engine_flags(omit=("incremental",), after="stride")
def perplexity_cmd(
    model_dir: Path = typer.Argument(..., help="Model directory (safetensors shards, config.json)."),
    file: Path = typer.Argument(..., help="Text file to score (its bytes, verbatim)."),
    ctx: int = typer.Option(256, "--ctx", help="Window length in tokens."),
    stride: int = typer.Option(None, "--stride", help="Window step (1..ctx-1; default ctx/2)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
    *,
    flags: EngineFlags,
) -> None:
    """Score FILE under MODEL: mean NLL per token and perplexity, as llama.cpp's tool."""
    s = check_window(ctx, stride)
    request = flags.request(model_dir=model_dir, positions=ctx, needs_tokenizer=True)
    data = read_text_file(file)
    ids: list[int] = []

    def tokenize(plan: EnginePlan) -> None:  # before the weights are bound
        assert plan.tokenizer is not None  # the request requires one
        ids.extend(plan.tokenizer.encode_bytes(data, allow_special=False))

    engine = open_engine(request, on_plan=tokenize)
    try:
        with Progress("perplexity", unit="window", quiet=quiet) as bar:
            res = perplexity(engine.model, ids, ctx, s, progress=bar.callback())
    finally:
        engine.close()
    if as_json:
        doc = {"model": str(model_dir), "file": str(file), "bytes": len(data),
               "kernel": engine.names["kernel"], **res.to_json()}
        print(json.dumps(doc, indent=2, allow_nan=False))
        return
    print(f"{engine.settings_line}\nfile       : {file} ({len(data)} bytes)", file=sys.stdout)
    for line in res.lines():
        print(line)


def register(app: typer.Typer) -> None:
    app.command("perplexity")(perplexity_cmd)
