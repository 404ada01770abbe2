"""Run settings and where each came from: flag > environment > preset > default.

:func:`merge_settings` takes the four layers and returns the validated :class:`Settings`
plus, for every field, the layer that set it (``"flag --threads"``, ``"env K3_THREADS"``,
``"preset laptop"``, ``"default"``) so a run can print how it was configured.

Environment variables (docs/engine-behaviours.md §1):

==================  =========================================================
``K3_MODEL_DIR``    the checkpoint directory (``model_dir``)
``K3_TOK_FILES``    the directory holding ``tiktoken.model`` (``tok``)
``K3_THREADS``      kernel threads (``threads``)
``OMP_NUM_THREADS`` kernel threads when ``K3_THREADS`` is not set
==================  =========================================================

Unlike the reference engine, where a preset assigns the budgets at its place in argv and a
*later* flag overwrites them, a flag here always wins whatever its position
(``--trunk-gb 20 --preset server`` gives trunk 20 GB).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k3core.api.errors import UsageError, param
from k3core.api.units import MAX_GB
from k3core.experts.readers import READERS_LIMIT

#: environment variable -> setting, highest priority first within one setting
ENV_VARS: tuple[tuple[str, str], ...] = (
    ("K3_MODEL_DIR", "model_dir"),
    ("K3_TOK_FILES", "tok"),
    ("K3_THREADS", "threads"),
    ("OMP_NUM_THREADS", "threads"),
)
#: preset keys that are settings (the rest, like notes, describe the preset)
PRESET_KEYS = ("trunk_gb", "cache_gb", "ultra_low_memory", "backend", "storage",
               "cache_policy", "threads", "incremental", "lookahead", "expert_readers")
#: the most kernel threads a setting (a flag, ``$K3_THREADS``, a preset) may ask for
MAX_THREADS = 4096
#: ``lookahead`` values (docs/expert-cache.md), and the pattern a settings value matches
LOOKAHEAD_MODES = ("on", "off", "attn", "out")
LOOKAHEAD_PATTERN = rf"^({'|'.join(LOOKAHEAD_MODES)})$"


class Settings(BaseModel):
    """Everything a run is configured by, validated. Budgets in decimal GB."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path | None = None
    tok: Path | None = None
    preset: str | None = None
    # the reference engine's defaults; finite and at most 1 PB (k3core.api.units.check_gb)
    trunk_gb: float = Field(default=16.0, ge=0, le=MAX_GB, allow_inf_nan=False)
    cache_gb: float = Field(default=64.0, ge=0, le=MAX_GB, allow_inf_nan=False)
    ultra_low_memory: bool = False
    backend: str = "auto"
    storage: str = "auto"
    cache_policy: str | None = None  # None: the engine's default policy
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    incremental: bool = True  # incremental decoding; --full-recompute opts out
    lookahead: str = Field(default="off", pattern=LOOKAHEAD_PATTERN)  # router lookahead
    #: expert-cache reader threads; None: sized by the storage device (k3core.experts.readers)
    expert_readers: int | None = Field(default=None, ge=1, le=READERS_LIMIT)


DEFAULTS: dict[str, Any] = Settings().model_dump()


@dataclass(frozen=True, kw_only=True)
class MergedSettings:
    """The settings and, per field, which layer set it."""

    settings: Settings
    sources: dict[str, str]

    def describe(self) -> list[str]:
        """``field = value  (source)`` lines for every field not left at its default."""
        d = self.settings.model_dump()
        return [f"{k} = {d[k]}  ({src})" for k, src in self.sources.items() if src != "default"]


def env_layer(environ: Mapping[str, str] | None = None) -> dict[str, tuple[Any, str]]:
    """Settings found in the environment: ``{field: (value, "env NAME")}``."""
    env = os.environ if environ is None else environ
    out: dict[str, tuple[Any, str]] = {}
    for var, key in ENV_VARS:
        raw = env.get(var)
        if raw is None or raw.strip() == "" or key in out:
            continue
        value: Any = raw
        if key == "threads":
            value = _positive_int(var, raw)
        out[key] = (value, f"env {var}")
    return out


def _positive_int(var: str, raw: str) -> int:
    text = raw.strip()
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{var}={raw!r} is not a positive integer")
    return int(text)


def _preset_layer(preset: BaseModel | Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    if preset is None:
        return {}, ""
    if isinstance(preset, BaseModel):
        name = getattr(preset, "name", "?")
        data = preset.model_dump()
    else:
        data = dict(preset)
        name = str(data.get("name", "?"))
    values = {k: data[k] for k in PRESET_KEYS if data.get(k) is not None}
    values["preset"] = name
    return values, f"preset {name}"


def merge_settings(
    defaults: Mapping[str, Any] | None,
    preset: BaseModel | Mapping[str, Any] | None,
    env: Mapping[str, str] | None,
    flags: Mapping[str, Any],
    given_as: str = "flag",
) -> MergedSettings:
    """Combine the layers: a flag beats the environment beats the preset beats the default.

    ``given_as`` names the top layer in the sources: ``"flag"`` (``flag --threads``, the
    command line) or ``"keyword"`` (``keyword threads``, the Python API).

    ``defaults`` overrides :data:`DEFAULTS` (``None`` keeps them); ``preset`` is a
    :class:`~k3core.run.presets.Preset` or a mapping with the same keys; ``env`` is the raw
    environment (``None`` = ``os.environ``, ``{}`` = ignore it); ``flags`` maps setting names
    to command-line values, ``None`` meaning "not given".
    """
    values: dict[str, Any] = dict(DEFAULTS)
    sources = {k: "default" for k in values}
    for k, v in (defaults or {}).items():
        _known(k, "defaults")
        values[k] = v
    pvalues, psource = _preset_layer(preset)
    for k, v in pvalues.items():
        values[k], sources[k] = v, psource
    for k, (v, src) in env_layer(env).items():
        values[k], sources[k] = v, src
    for k, v in flags.items():
        _known(k, "flags")
        if v is not None:
            values[k], sources[k] = v, _given(k, given_as)
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        err = exc.errors(include_input=False, include_url=False)[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        raise UsageError(f"{key} (from {sources.get(key, '?')}): {err['msg']}") from None
    if settings.preset == "auto" and settings.ultra_low_memory:
        raise UsageError(f"{param('ultra_low_memory')} cannot be combined with the auto "
                         f"preset; use {param('preset')} ultra, or explicit "
                         f"{param('trunk_gb')}/{param('cache_gb')}")
    return MergedSettings(settings=settings, sources=sources)


def _given(key: str, given_as: str) -> str:
    if given_as == "keyword":
        return f"keyword {key}"
    return "argument MODEL_DIR" if key == "model_dir" else f"flag --{key.replace('_', '-')}"


def _known(key: str, layer: str) -> None:
    if key not in DEFAULTS:
        raise UsageError(f"unknown setting {key!r} in {layer}; known: {', '.join(DEFAULTS)}")
