"""Memory presets: declarative YAML files naming two budgets and a few optional settings.

A preset is data, never code. Files are read as UTF-8 (at most 64 kB), scanned as YAML
events first (no construction: anchors, aliases, explicit tags such as
``!!python/object`` and nesting are refused, as are duplicate keys), then loaded with
``yaml.safe_load`` and validated by :class:`Preset` (``extra="forbid"``: an unknown key is
refused by name). Every problem is a :class:`PresetError` (exit 2) naming the file.

Where presets come from (first match wins):

1. a path (anything containing a path separator or ending in ``.yaml``/``.yml``);
2. the user's directory: ``$K3_CONFIG_DIR/presets``, else ``$XDG_CONFIG_HOME/k3/presets``,
   else ``~/.config/k3/presets`` (``NAME.yaml``; a user file overrides a shipped one);
3. the presets shipped with k3 (package ``k3_presets``).

``auto`` is not a file: it is computed from the memory available (``k3core.run.preset_auto``).
Settings precedence (flag > environment > preset > default) lives in ``k3core.run.settings``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, cast

import yaml
from pydantic import ValidationError

from k3core.api.errors import K3Error
from k3core.api.files import FileRejected, read_capped
from k3core.api.units import human

if TYPE_CHECKING:
    from k3core.api.specs import Kind
    from k3core.model.config import ModelConfig
    from k3core.model.sizes import ModelSizes
    from k3core.plugins.registry import Registry

from k3core.run.preset import (  # noqa: F401 - the record's names, re-exported
    AUTO,
    MAX_DEPTH,
    MAX_EVENTS,
    MAX_GB,
    MAX_PRESET_BYTES,
    NAME_PATTERN,
    PLUGIN_PATTERN,
    SHIPPED,
    Preset,
    PresetError,
)
from k3core.run.preset_auto import auto_preset
from k3core.run.settings import MergedSettings, Settings, merge_settings  # noqa: F401 - re-exported


# ---- reading -------------------------------------------------------------------------------
def parse_preset(text: str | bytes, source: str = "<preset>") -> Preset:
    """Validate one preset document; raise :class:`PresetError` naming every problem."""
    doc = parse_document(text, source)
    problems = validation_problems(doc)
    if problems:
        raise PresetError(f"{source}: not a valid preset: " + "; ".join(problems))
    return Preset.model_validate(doc)


def parse_document(text: str | bytes, source: str = "<preset>") -> dict[str, object]:
    """The YAML stage alone: size, encoding, events, a top-level mapping of string keys.

    What this refuses (``PresetError``) stops everything; what :func:`validation_problems`
    finds in the mapping can all be reported together.
    """
    if isinstance(text, bytes):
        if len(text) > MAX_PRESET_BYTES:
            raise PresetError(f"{source}: {len(text)} bytes is larger than the "
                              f"{human(MAX_PRESET_BYTES)} limit for a preset")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PresetError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                              ) from None
    if len(text) > MAX_PRESET_BYTES:
        raise PresetError(f"{source}: larger than the {human(MAX_PRESET_BYTES)} limit")
    _scan_events(text, source)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PresetError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    except (RecursionError, ValueError, OverflowError) as exc:
        raise PresetError(f"{source}: not valid YAML: {exc}") from None
    if doc is None:
        raise PresetError(f"{source}: empty; a preset needs at least name, trunk_gb, cache_gb")
    if not isinstance(doc, dict):
        raise PresetError(f"{source}: the top level must be a mapping of keys to values, "
                          f"not {type(doc).__name__}")
    bad = [k for k in doc if not isinstance(k, str)]
    if bad:
        raise PresetError(f"{source}: every key must be a string (found {len(bad)} that are not)")
    return doc


def validation_problems(doc: dict[str, object]) -> list[str]:
    """Every problem the record's rules find in a parsed document (empty when valid)."""
    try:
        Preset.model_validate(doc)
    except ValidationError as exc:
        return _problems(exc)
    return []


#: events only, nothing constructed: libyaml's parser when PyYAML was built with it
_EVENT_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _scan_events(text: str, source: str) -> None:
    """Refuse what a preset never needs, before anything is constructed."""
    depth = 0
    count = 0
    keys: list[str] = []
    expect_key = False
    try:
        for ev in yaml.parse(text, Loader=_EVENT_LOADER):
            count += 1
            if count > MAX_EVENTS:
                raise PresetError(f"{source}: too many YAML nodes for a preset")
            if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None):
                raise PresetError(f"{source}: YAML anchors and aliases are not allowed in a preset")
            tag = getattr(ev, "tag", None)
            if tag and tag != "!" and isinstance(ev, (yaml.NodeEvent,)):
                raise PresetError(f"{source}: the YAML tag {tag!r} is not allowed in a preset "
                                  "(presets are plain data; no tag may construct an object)")
            if isinstance(ev, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise PresetError(f"{source}: nested values are not allowed in a preset")
                if depth == 1:
                    expect_key = isinstance(ev, yaml.MappingStartEvent)
                continue
            if isinstance(ev, yaml.CollectionEndEvent):
                depth -= 1
                continue
            if isinstance(ev, yaml.ScalarEvent) and depth == 1:
                if expect_key:
                    if ev.value in keys:
                        raise PresetError(f"{source}: key {ev.value!r} appears twice")
                    keys.append(ev.value)
                expect_key = not expect_key
            elif depth == 1 and isinstance(ev, yaml.NodeEvent):
                expect_key = not expect_key
    except yaml.YAMLError as exc:
        raise PresetError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise PresetError(f"{source}: not valid YAML: nested too deeply") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"[:300]


def _problems(exc: ValidationError) -> list[str]:
    allowed = ", ".join(Preset.model_fields)
    out = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            out.append(f"unknown key {loc!r} (allowed keys: {allowed})")
        elif err["type"] == "missing":
            out.append(f"missing key {loc!r}")
        else:
            out.append(f"{loc}: {err['msg']}")
    return out[:32]


def _read_bytes(p: Path) -> bytes:
    if not p.is_file():
        raise PresetError(f"{p}: no such preset file")
    try:
        return read_capped(p, MAX_PRESET_BYTES)
    except FileRejected as exc:
        raise PresetError(f"{p}: {exc} (a preset)") from None


def file_problems(path: str | Path, registry: Registry | None = None,
                  plugins: bool = True) -> tuple[Preset | None, list[str]]:
    """Everything wrong with the preset file at ``path``, all at once.

    The rules ``--preset`` applies to a file, whichever way it was named: the name ends in
    ``.yaml``/``.yml``, the document is a valid preset, its ``name`` equals the file name
    (``my-box.yaml`` says ``name: my-box``), it is not ``auto``, and (with ``plugins``) every
    plugin it names is registered and available here. Returns the preset (``None`` when the
    document is not valid) and the problems (empty when the file is usable).
    """
    p = Path(path)
    problems: list[str] = []
    if p.suffix not in (".yaml", ".yml"):
        problems.append(f"a preset file's name must end in .yaml or .yml, not {p.suffix or '(no suffix)'!r}")
    doc = parse_document(_read_bytes(p), str(p))  # not YAML at all: nothing else to check
    problems += validation_problems(doc)
    name = doc.get("name")
    if isinstance(name, str):
        if name != p.stem:
            problems.append(f"the file is named {p.stem!r} but says name: {name!r}; make them "
                            "agree")
        if name == AUTO:
            problems.append("'auto' is reserved (it is computed)")
    if plugins:
        named = {"kernel": doc.get("backend"), "storage": doc.get("storage"),
                 "cache": doc.get("cache_policy")}
        problems += _plugin_problems({k: v for k, v in named.items() if isinstance(v, str)},
                                     registry)
    preset = None
    if not validation_problems(doc):
        preset = Preset.model_validate(doc).with_origin(str(p))
    return preset, problems


def check_preset_file(path: str | Path, registry: Registry | None = None,
                      plugins: bool = False) -> Preset:
    """The preset at ``path`` if :func:`file_problems` finds nothing, else one
    ``PresetError`` (exit 2) naming every problem."""
    preset, problems = file_problems(path, registry, plugins)
    if problems or preset is None:
        raise PresetError(f"{path}: " + "; ".join(problems))
    return preset


# ---- finding -------------------------------------------------------------------------------
def user_preset_dir(environ: dict[str, str] | None = None) -> Path:
    """``$K3_CONFIG_DIR/presets``, else ``$XDG_CONFIG_HOME/k3/presets``, else ``~/.config/k3/presets``."""
    env = os.environ if environ is None else environ
    if env.get("K3_CONFIG_DIR"):
        return Path(env["K3_CONFIG_DIR"]) / "presets"
    if env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"]) / "k3" / "presets"
    return Path.home() / ".config" / "k3" / "presets"


def shipped_preset_dir() -> Path:
    return Path(str(resources.files("k3_presets")))


def _is_path(name: str) -> bool:
    return os.sep in name or "/" in name or name.endswith((".yaml", ".yml"))


def preset_names() -> list[str]:
    """Every preset name a user can pass to ``--preset`` (``auto`` first)."""
    return [AUTO] + [p.name for p in list_presets(on_error=lambda e: None)]


def load_preset(name_or_path: str, *, cfg: ModelConfig | None = None,
                sizes: ModelSizes | None = None, available: int | None = None,
                total: int | None = None, overhead: int | None = None) -> Preset:
    """A preset by name (user directory, then shipped), by path, or ``auto`` (computed).

    ``auto`` plans for ``cfg``/``sizes`` (Kimi K3's planned sizes when both are omitted)
    against ``available``/``total`` memory (psutil's figures when omitted); ``overhead`` is
    the run's fixed cost besides the budgets (see ``k3core.run.preset_auto.run_overhead``).
    """
    if name_or_path == AUTO:
        return auto_preset(sizes, cfg=cfg, available=available, total=total,
                           overhead=overhead)
    if _is_path(name_or_path):
        return check_preset_file(name_or_path)
    if re.fullmatch(NAME_PATTERN, name_or_path):
        for folder in (user_preset_dir(), shipped_preset_dir()):
            path = folder / f"{name_or_path}.yaml"
            if path.is_file():
                return check_preset_file(path)
    choices = preset_names()
    close = difflib.get_close_matches(name_or_path, choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise PresetError(f"unknown preset {name_or_path!r}{hint}; choices: {', '.join(choices)}")


def list_presets(on_error: Callable[[K3Error], None] | None = None) -> list[Preset]:
    """Shipped presets in their order (a user file of the same name replaces one), then the
    user's own presets by total budget. A broken user file raises unless ``on_error``."""
    found: dict[str, Preset] = {}
    user = user_preset_dir()
    for folder in (shipped_preset_dir(), user):
        try:
            files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
        except OSError:
            files = []
        for path in files:
            try:
                preset = check_preset_file(path)
            except K3Error as exc:
                if on_error is None:
                    raise
                on_error(exc)
                continue
            found[preset.name] = preset
    shipped = [found.pop(n) for n in SHIPPED if n in found]
    extra = sorted(found.values(), key=lambda p: (p.trunk_gb + p.cache_gb, p.name))
    return shipped + extra


def table_lines(presets: list[Preset]) -> list[str]:
    """The reference's ``--list-presets`` table."""
    out = ["presets (trunk / expert-cache, in GB):"]
    for p in presets:
        note = p.notes or p.description
        tags = [tag for tag, on in (("ultra-low-memory", p.ultra_low_memory and "ultra" not in note),
                                    ("needs --trunk", p.needs_trunk)) if on]
        if tags:
            note = f"{note} ({', '.join(tags)})".strip()
        out.append(f"  {p.name:<12}{p.trunk_gb:7.2f} / {p.cache_gb:7.2f}  {note}".rstrip())
    out.append(f"  {AUTO:<12}{'fit':>7} / {'fit':>7}  computed from the memory available now "
               "(Recommended)")
    needing = [p.name for p in presets if p.needs_trunk]
    only = (f"Only {', '.join(needing)} need{'s' if len(needing) == 1 else ''} --trunk."
            if needing else "None needs --trunk.")
    out.append("The trunk budget applies with --trunk <packed_dir> (`k3 pack-trunk MODEL_DIR "
               "TRUNK_DIR` makes one); without it the trunk stays resident and only the cache "
               f"budget applies. {only}")
    out.append("Not sure which fits? `k3 doctor MODEL_DIR` checks this machine and prints "
               "the command to run.")
    return out


def check_plugins(preset: Preset, registry: Registry | None = None) -> list[str]:
    """Every plugin the preset names that cannot run here, one problem each (empty: all fine).

    Only problems are returned: a plugin that resolves is not a note to raise.
    """
    return _plugin_problems({str(k): v for k, v in preset.plugins().items()}, registry)


def _plugin_problems(named: Mapping[str, str], registry: Registry | None) -> list[str]:
    from k3core.plugins.registry import KIND_WORDS, get_registry

    reg = registry or get_registry()
    out = []
    for kind, name in named.items():
        if name == AUTO:
            continue
        k = cast("Kind", kind)
        if name not in reg.names(k):
            choices = ", ".join(reg.names(k)) or "(none)"
            out.append(f"{KIND_WORDS[k]} {name!r} is not registered (registered: {choices})")
            continue
        try:
            reg.resolve(k, name)
        except K3Error as exc:
            out.append(exc.message)
    return out
