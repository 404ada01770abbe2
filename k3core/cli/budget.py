"""``k3 budget MODEL_DIR``: resident set versus what streams, and each preset's memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from k3core.api.errors import UsageError
from k3core.cli.guard import guarded
from k3core.model.config import ModelConfig
from k3core.plugins.registry import get_registry
from k3core.run.presets import list_presets
from k3core.tools.budget import add_plans, budget_report


@guarded
def budget(
    model_dir: Path = typer.Argument(None, help="Checkpoint directory (default: $K3_MODEL_DIR)."),
    config: Path = typer.Option(None, "--config", help="Model config (default MODEL_DIR/config.json)."),
    storage: str = typer.Option("auto", "--storage", help="Storage backend used to read headers."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Prompt tokens to plan for."),
    gen: int = typer.Option(8, "--gen", help="Generated tokens to plan for."),
    incremental: bool = typer.Option(True, "--incremental/--full-recompute",
                                     help="Plan incremental decoding or full recompute (both hold the latent KV cache)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    shape: str = typer.Option(None, "--shape",
                              help="Plan a named shape (tiny, small, medium, real) from its "
                                   "config alone: each preset's streamed-trunk plan, no data."),
) -> None:
    """Classify every tensor (trunk, tables, routed experts) and plan each preset's memory."""
    from k3core.run.settings import env_layer
    from k3core.tools.trunk_plans import preset_trunk_plans, trunk_plan_lines

    presets = list_presets(on_error=lambda e: None)
    if shape is not None:
        if model_dir is not None:
            raise UsageError("give MODEL_DIR or --shape, not both")
        cfg = shape_config(shape)
        plans = preset_trunk_plans(cfg, presets)
        if as_json:
            print(json.dumps({"shape": shape, "trunk_plans": [p.to_json() for p in plans]},
                             indent=2))
            return
        print(cfg.describe())
        for line in trunk_plan_lines(cfg, plans):
            print(line)
        return
    if model_dir is None:
        found = env_layer().get("model_dir")
        if found is None:
            raise UsageError("give MODEL_DIR or set K3_MODEL_DIR")
        model_dir = Path(found[0])
    if prompt_len < 0 or gen < 0:
        raise UsageError("--prompt-len and --gen must not be negative")
    backend, _, _ = get_registry().create("storage", storage, for_path=model_dir)
    report = budget_report(model_dir, backend, config)
    add_plans(report, presets, prompt_len=prompt_len, gen=gen, incremental=incremental)
    trunk_plans = preset_trunk_plans(report.cfg, presets)
    if as_json:
        doc = report.to_json()
        doc["trunk_plans"] = [p.to_json() for p in trunk_plans]
        print(json.dumps(doc, indent=2))
        return
    for line in report.lines() + trunk_plan_lines(report.cfg, trunk_plans):
        print(line)


def shape_config(name: str) -> ModelConfig:
    """The config of a named shape; an unknown name is a usage error (exit 2)."""
    from k3core.model.shapes import SIZES, size_config

    if name not in SIZES:
        raise UsageError(f"--shape must be one of {', '.join(SIZES)}, got {name!r}")
    return ModelConfig.from_json_dict(size_config(name), source=f"shape {name}")


def register(app: typer.Typer) -> None:
    app.command("budget")(budget)
