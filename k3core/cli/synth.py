"""``k3 synth OUT_DIR``: write a deterministic synthetic checkpoint (random weights)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from k3core.api.errors import UsageError
from k3core.api.units import human
from k3core.cli.guard import guarded
from k3core.cli.progress import Progress
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


_SIZES = [s for s in SIZES if s != "real"] + ["full"]


@guarded
def synth(
    out_dir: Path = typer.Argument(..., help="Directory to create."),
    size: str = typer.Option("tiny", "--size", help=f"One of: {', '.join(_SIZES)} "
                             "(full = the released Kimi K3 shape, --sparse only)."),
    seed: int = typer.Option(0, "--seed", help="Seed; the same seed writes the same bytes."),
    set_: list[str] = typer.Option([], "--set", help="Override a config key, e.g. --set num_hidden_layers=5."),
    sparse: bool = typer.Option(False, "--sparse", help="Released dtypes, data as holes plus a "
                                "small pattern: a few tens of MB on disk at any shape."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    """Write a synthetic Kimi K3 checkpoint in the released layout (its weights are random)."""
    if size not in _SIZES:
        raise UsageError(f"unknown --size {size!r}; choose one of {', '.join(_SIZES)}")
    if size == "full" and not sparse:
        raise UsageError("--size full writes 1.56 TB of data; pass --sparse to write its "
                         "shapes and headers with the data as holes")
    if seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")
    name = "real" if size == "full" else size
    cfg = ModelConfig.from_json_dict(size_config(name, _overrides(set_)), source=f"--size {size}")
    vision = size == "full"
    total = cfg.n_layers + 1 + (2 if vision else 0)
    what = "logical" if sparse else "written"
    with Progress("synth", total, unit="shard", quiet=quiet) as bar:
        path = synthesize(out_dir, cfg, seed, force=force, sparse=sparse, vision=vision,
                          progress=lambda d, t, n: bar.update(d, t, f"{human(n)} {what}"))
    kind = "sparse: holes plus a small pattern" if sparse else "random"
    print(f"wrote {path} ({cfg.describe().removeprefix('config: ')}); its weights are {kind} "
          f"(seed {seed})")


def register(app: typer.Typer) -> None:
    app.command("synth")(synth)
