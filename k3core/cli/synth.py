"""``k3 synth OUT_DIR``: write a deterministic synthetic checkpoint (random weights)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from k3core.api.errors import UsageError
from k3core.cli.guard import guarded
from k3core.model.config import ModelConfig
from k3core.model.shapes import SIZES, size_config
from k3core.tools.synth.writer import synthesize


def settable_keys() -> list[str]:
    """The flat config keys ``--set`` may override: every key the config reader reads."""
    from k3core.model.config_keys import KEYS, PINNED

    keys = {n for k in KEYS for n in k.names} | {k for k, _, _ in PINNED}
    keys |= {"kda_layers", "bos_token_id", "eos_token_id", "pad_token_id"}
    return sorted(keys)


def _overrides(pairs: list[str]) -> dict[str, object]:
    import difflib

    out: dict[str, object] = {}
    known = settable_keys()
    for p in pairs:
        key, sep, val = p.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects KEY=VALUE (a config key), got {p!r}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"--set {key}: not a config key{hint}; the keys are "
                             f"{', '.join(known)}")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--set {key}: {val!r} is not a JSON value") from exc
    return out


@guarded
def synth(
    out_dir: Path = typer.Argument(..., help="Directory to create."),
    size: str = typer.Option("tiny", "--size", help=f"One of: {', '.join(s for s in SIZES if s != 'real')}."),
    seed: int = typer.Option(0, "--seed", help="Seed; the same seed writes the same bytes."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key, e.g. --set num_hidden_layers=5."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists."),
) -> None:
    """Write a synthetic Kimi K3 checkpoint in the released layout (its weights are random)."""
    if size not in SIZES or size == "real":
        raise UsageError(f"unknown --size {size!r}; choose one of {', '.join(s for s in SIZES if s != 'real')}")
    if seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")
    cfg = ModelConfig.from_json_dict(size_config(size, _overrides(set_)), source=f"--size {size}")
    with Progress(TextColumn("synth"), BarColumn(), TextColumn("{task.completed}/{task.total} shards"), TimeElapsedColumn()) as bar:
        task = bar.add_task("synth", total=cfg.n_layers + 1)
        path = synthesize(out_dir, cfg, seed, force=force, progress=lambda d, t: bar.update(task, completed=d))
    print(f"wrote {path} ({cfg.describe().removeprefix('config: ')}); its weights are random (seed {seed})")


def register(app: typer.Typer) -> None:
    app.command("synth")(synth)
