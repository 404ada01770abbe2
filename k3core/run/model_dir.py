"""Finding a model's ``config.json``, and saying plainly why it is not there.

``k3 run MODEL_DIR`` needs ``MODEL_DIR/config.json`` (or ``--config PATH``). When it is
missing, :func:`config_path` says which of these it is, as one ``UsageError`` (exit 2, the
rule for every missing input path; ``docs/exit-codes.md``): the directory does not exist,
it is not a directory, or it holds no model, naming the subdirectories (up to two levels
down) that do hold one, so a download's nested layout is one copy-paste away.
"""

from __future__ import annotations

from pathlib import Path

from k3core.api.errors import UsageError, param

CONFIG_NAME = "config.json"
#: subdirectories looked at for a model, at most
MAX_LOOK = 200


def config_path(model_dir: Path, config: Path | None = None) -> Path:
    """The config to read; ``UsageError`` naming the problem when there is none."""
    if config is not None:
        if not config.exists():
            raise UsageError(f"{param('config')} {config} does not exist")
        if not config.is_file():
            raise UsageError(f"{param('config')} {config} is not a file")
        return config
    if not model_dir.exists():
        raise UsageError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise UsageError(f"{param('model_dir')} {model_dir} is not a directory")
    path = model_dir / CONFIG_NAME
    if path.is_file():
        return path
    found = models_below(model_dir)
    if found:
        return _raise_nested(model_dir, found)
    raise UsageError(f"{model_dir} holds no model: there is no {CONFIG_NAME} in it (pass "
                     f"{param('config')} PATH if the config lives elsewhere)")


def _raise_nested(model_dir: Path, found: list[Path]) -> Path:
    listed = ", ".join(str(p) for p in found[:3]) + (" ..." if len(found) > 3 else "")
    raise UsageError(f"{model_dir} holds no model ({CONFIG_NAME} is missing), but "
                     f"{'a subdirectory does' if len(found) == 1 else 'subdirectories do'}: "
                     f"{listed}; run `k3 run {found[0]} ...`")


def models_below(root: Path, depth: int = 2) -> list[Path]:
    """Subdirectories of ``root`` (down to ``depth`` levels) holding a ``config.json``."""
    out: list[Path] = []
    level = [root]
    looked = 0
    for _ in range(depth):
        nxt: list[Path] = []
        for d in level:
            try:
                subs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            for s in subs:
                looked += 1
                if looked > MAX_LOOK:
                    return out
                if (s / CONFIG_NAME).is_file():
                    out.append(s)
                else:
                    nxt.append(s)
        level = nxt
    return out
