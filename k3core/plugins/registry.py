"""The plugin registry: finds kernel, storage and cache plugins and resolves names.

Rules (docs/plugins.md §3):

* plugins come from the ``k3`` entry-point group; built-ins use the same group;
* an unknown name is an error listing the registered names and a close match;
* a registered but unavailable implementation is an error with the reason and the fix;
* an explicit choice never falls back; only ``auto`` picks (highest available priority)
  and says what it picked; given a path (the model directory), ``auto`` also skips a
  storage backend whose class says it cannot read there (``probe_path``, the storage
  contract's optional hook) and says why;
* two plugins claiming one name is an error naming both;
* ``K3_DISABLE_PLUGINS=1`` loads only the plugins shipped with k3 itself;
  ``K3_DISABLE_BACKENDS=a,b`` marks those implementations unavailable (tests use it to
  force the fallback paths).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy

from k3core.api import hookspecs
from k3core.api.errors import K3Error, PluginError
from k3core.api.specs import Availability, Kind, PluginSpec

K3_DIST = "k3"
HOOKS: dict[Kind, str] = {
    "kernel": "k3_kernel_backends",
    "storage": "k3_storage_backends",
    "cache": "k3_cache_policies",
}
KIND_WORDS: dict[Kind, str] = {
    "kernel": "kernel backend",
    "storage": "storage backend",
    "cache": "cache policy",
}


@dataclass
class Entry:
    """One registered implementation and where it came from."""

    spec: PluginSpec
    origin: str  # "dist==version (module)"
    conflict_with: str | None = None
    dist: str = ""  # the distribution that registered it ('' when added by hand)


@dataclass
class BrokenPlugin:
    """An entry point that failed to load or whose hook failed."""

    name: str
    origin: str
    reason: str


@dataclass
class Registry:
    """All specs by kind and name, plus plugins that failed to load."""

    entries: dict[Kind, dict[str, Entry]] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)
    _probes: dict[tuple[Kind, str], Availability] = field(default_factory=dict)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def discover(cls) -> Registry:
        """Load every entry point of the ``k3`` group and collect the specs."""
        reg = cls(entries={k: {} for k in HOOKS})
        only_builtin = os.environ.get("K3_DISABLE_PLUGINS", "") not in ("", "0")
        for ep in sorted(_entry_points(), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            origin = f"{dist}=={version} ({ep.value})"
            if only_builtin and _norm(dist) != K3_DIST:
                continue
            try:
                plugin = ep.load()
            except (Exception, SystemExit) as exc:  # a third-party plugin may do anything
                reg.broken.append(BrokenPlugin(ep.name, origin, f"failed to import: {_brief(exc)}"))
                continue
            reg.add_plugin(plugin, origin, ep.name, dist=dist)
        return reg

    def add_plugin(self, plugin: Any, origin: str, name: str = "", dist: str = "") -> None:
        """Register one plugin object (module or instance with hook implementations)."""
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        try:
            pm.register(plugin, name=name or origin)
        except (Exception, SystemExit) as exc:
            self.broken.append(BrokenPlugin(name, origin, f"not a valid k3 plugin: {_brief(exc)}"))
            return
        if not pm.get_hookcallers(plugin):
            self.broken.append(BrokenPlugin(name, origin, _no_hooks(plugin)))
            return
        for kind, hook in HOOKS.items():
            try:
                results = getattr(pm.hook, hook)()
            except (Exception, SystemExit) as exc:
                self.broken.append(BrokenPlugin(name, origin, f"{hook}() raised {_brief(exc)}"))
                continue
            for specs in results:
                if specs is None:
                    continue
                if not isinstance(specs, (list, tuple)):
                    self.broken.append(BrokenPlugin(
                        name, origin, f"{hook}() returned {_brief(specs)}, not a list of specs"))
                    continue
                for spec in specs:
                    self._add(kind, spec, origin, name, dist)

    def _add(self, kind: Kind, spec: Any, origin: str, plugin_name: str, dist: str = "") -> None:
        problem = spec_problem(kind, spec)
        if problem:
            self.broken.append(BrokenPlugin(plugin_name, origin, f"{HOOKS[kind]}() {problem}"))
            return
        table = self.entries.setdefault(kind, {})
        existing = table.get(spec.name)
        if existing is not None:
            existing.conflict_with = origin
            return
        table[spec.name] = Entry(spec, origin, dist=dist)

    # ---- queries ---------------------------------------------------------------------
    def names(self, kind: Kind) -> list[str]:
        return sorted(self.entries.get(kind, {}))

    def available(self, kind: Kind) -> list[str]:
        """Names that can run here, in the order ``auto`` tries them (best first)."""
        ranked = sorted(self.entries.get(kind, {}).values(),
                        key=lambda e: (-e.spec.priority, e.spec.name))
        return [e.spec.name for e in ranked
                if e.conflict_with is None and self.probe(kind, e.spec.name).ok]

    def check_factory(self, kind: Kind, name: str) -> str:
        """Import ``name``'s factory without calling it: '' when it loads, else why not."""
        entry = self.entries.get(kind, {}).get(name)
        if entry is None:
            return f"no {KIND_WORDS[kind]} named '{name}' is registered"
        spec = entry.spec
        module_name, _, attr = spec.factory.partition(":")
        try:
            obj = spec.load()
        except ModuleNotFoundError as exc:
            return f"its factory {spec.factory!r} names a module that cannot be imported: " \
                   f"{_brief(exc)}"
        except AttributeError:
            return f"its factory {spec.factory!r}: module {module_name} has no attribute {attr!r}"
        except (Exception, SystemExit) as exc:
            return f"importing its factory {spec.factory!r} raised {_brief(exc)}"
        if not callable(obj):
            return f"its factory {spec.factory!r} is {_brief(obj)}, not a class or a callable"
        base = _base_class(kind)
        if isinstance(obj, type) and not issubclass(obj, base):
            return (f"its factory {spec.factory!r} is the class {obj.__name__}, not a subclass "
                    f"of {base.__module__}.{base.__name__}")
        return ""

    def hint(self, kind: Kind, name: str, hint: str = "") -> str:
        """The fix to show for ``name`` (``hint``, else its spec's ``install_hint``), never an
        install command for a distribution that is already installed."""
        entry = self.entries.get(kind, {}).get(name)
        text = hint or (_hint(entry.spec) if entry is not None else "")
        if _installs_something_installed(text):
            dist = entry.dist if entry is not None and entry.dist else "the plugin"
            return (f"{dist} is installed: the fault is in the plugin itself (run "
                    f"`k3 backends --check`; report it to the plugin's authors)")
        return text

    def probe(self, kind: Kind, name: str) -> Availability:
        """Cached availability of one implementation (a raising probe counts as unavailable)."""
        key = (kind, name)
        if key not in self._probes:
            self._probes[key] = self._probe_uncached(kind, name)
        return self._probes[key]

    def _probe_uncached(self, kind: Kind, name: str) -> Availability:
        disabled = {s.strip() for s in os.environ.get("K3_DISABLE_BACKENDS", "").split(",")}
        if name in disabled:
            return Availability.no(
                f"disabled by K3_DISABLE_BACKENDS={os.environ['K3_DISABLE_BACKENDS']}",
                "unset K3_DISABLE_BACKENDS",
            )
        entry = self.entries.get(kind, {}).get(name)
        if entry is None:
            return Availability.no(f"no {KIND_WORDS[kind]} named '{name}' is registered")
        try:
            result = entry.spec.probe()
        except (Exception, SystemExit) as exc:
            return Availability.no(f"its probe raised {_brief(exc)}", self.hint(kind, name))
        if not isinstance(result, Availability):
            return Availability.no(f"its probe returned {_brief(result)}, not an Availability")
        if not isinstance(result.reason, str) or not isinstance(result.hint, str):
            return Availability.no(f"its probe returned {_brief(result)} (reason and hint must "
                                   "be strings)")
        return result

    def probe_path(self, kind: Kind, name: str, path: Path) -> Availability:
        """Whether ``name`` can work on the files at ``path``: its factory's optional
        ``probe_path(path)`` (the storage contract's hook; yes where there is none). A
        factory that cannot be imported, or a path probe that raises or answers something
        other than an ``Availability``, counts as no."""
        entry = self.entries.get(kind, {}).get(name)
        if entry is None:
            return Availability.no(f"no {KIND_WORDS[kind]} named '{name}' is registered")
        problem = self.check_factory(kind, name)
        if problem:
            return Availability.no(problem, self.hint(kind, name))
        hook = getattr(entry.spec.load(), "probe_path", None)
        if hook is None:
            return Availability.yes()
        try:
            result = hook(Path(path))
        except (Exception, SystemExit) as exc:
            return Availability.no(f"its probe_path raised {_brief(exc)}", self.hint(kind, name))
        if not isinstance(result, Availability):
            return Availability.no(f"its probe_path returned {_brief(result)}, not an "
                                   "Availability")
        return result

    def resolve(self, kind: Kind, name: str, *,
                for_path: Path | None = None) -> tuple[PluginSpec, str]:
        """Return ``(spec, note)`` for ``name`` (or ``auto``); never falls back.

        ``for_path`` (the model directory): ``auto`` skips an implementation that says it
        cannot work there (:meth:`probe_path`), and the note says which and why. An
        explicit name is not path-probed: it fails when it is used, with its own error.
        """
        word = KIND_WORDS[kind]
        table = self.entries.get(kind, {})
        if name == "auto":
            ranked = sorted(table.values(), key=lambda e: (-e.spec.priority, e.spec.name))
            skipped: list[str] = []
            for ranked_entry in ranked:
                spec = ranked_entry.spec
                if ranked_entry.conflict_with is not None or not self.probe(kind, spec.name).ok:
                    continue
                if for_path is not None:
                    there = self.probe_path(kind, spec.name, for_path)
                    if not there.ok:
                        skipped.append(f"{word} '{spec.name}' cannot read {for_path} "
                                       f"({there.reason})")
                        continue
                return spec, "; ".join([*skipped, f"auto picked {word} '{spec.name}'"])
            why = f" ({'; '.join(skipped)})" if skipped else ""
            raise PluginError(f"no {word} is available on this machine{why}",
                              hint="run `k3 backends`")
        entry = table.get(name)
        if entry is None:
            choices = ", ".join(self.names(kind)) or "(none)"
            close = difflib.get_close_matches(name, self.names(kind), n=1)
            broken = [b for b in self.broken if b.name == name]
            msg = f"unknown {word} '{name}'; registered: {choices}"
            if close:
                msg += f" (did you mean '{close[0]}'?)"
            if broken:
                msg += f"; plugin '{name}' from {broken[0].origin} {broken[0].reason}"
            raise PluginError(msg)
        if entry.conflict_with is not None:
            raise PluginError(
                f"{word} '{name}' is claimed by two plugins: {entry.origin} and "
                f"{entry.conflict_with}",
                hint="uninstall one of them, or set K3_DISABLE_PLUGINS=1 to use only built-ins",
            )
        avail = self.probe(kind, name)
        if not avail.ok:
            raise PluginError(
                f"{word} '{name}' is not available here: {avail.reason}",
                hint=self.hint(kind, name, avail.hint) or None,
            )
        return entry.spec, ""

    def create(self, kind: Kind, name: str, *, for_path: Path | None = None,
               **kwargs: Any) -> tuple[Any, str, str]:
        """Resolve (``for_path``: see :meth:`resolve`) and instantiate with ``kwargs``;
        returns ``(instance, resolved_name, note)``."""
        spec, note = self.resolve(kind, name, for_path=for_path)
        try:
            factory = spec.load()
            instance = factory(**kwargs)
        except K3Error:  # a refusal with its own message (and exit code)
            raise
        except (Exception, SystemExit) as exc:
            raise PluginError(
                f"{KIND_WORDS[kind]} '{spec.name}' failed to start: {_brief(exc)}",
                hint=self.hint(kind, spec.name) or None,
            ) from None
        base = _base_class(kind)
        if not isinstance(instance, base):
            raise PluginError(
                f"{KIND_WORDS[kind]} '{spec.name}' is broken: its factory {spec.factory} built "
                f"{_brief(instance)}, not a {base.__module__}.{base.__name__}")
        return instance, spec.name, note


def spec_problem(kind: Kind, spec: Any) -> str:
    """Why ``spec`` cannot be registered as a ``kind`` implementation ('' when it can)."""
    if not isinstance(spec, PluginSpec):
        return f"returned something that is not a spec: {_brief(spec)}"
    name = spec.name
    if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 64:
        return f"returned a spec with a bad name {_brief(name)}"
    if spec.kind != kind:
        return f"returned the {spec.kind} spec {name!r} from the {kind} hook"
    if not isinstance(spec.factory, str) or not spec.factory.partition(":")[0]:
        return f"returned spec {name!r} whose factory {_brief(spec.factory)} is not 'module:attr'"
    if isinstance(spec.priority, bool) or not isinstance(spec.priority, int):
        return f"returned spec {name!r} whose priority {_brief(spec.priority)} is not an integer"
    if not callable(spec.probe):
        return f"returned spec {name!r} whose probe is not callable"
    return ""


def _brief(obj: Any, limit: int = 160) -> str:
    """``repr(obj)`` cut to one short line (plugins are untrusted; so is their output)."""
    try:
        text = repr(obj)
    except Exception as exc:  # a hostile __repr__
        text = f"<unprintable {type(obj).__name__}: {type(exc).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _base_class(kind: Kind) -> type:
    """The class every instance of ``kind`` must derive from (imported late: no cycles)."""
    if kind == "kernel":
        from k3core.api.kernels import KernelBackend

        return KernelBackend
    if kind == "storage":
        from k3core.api.storage import StorageBackend

        return StorageBackend
    from k3core.api.cache_policy import CachePolicy

    return CachePolicy


def _hint(spec: PluginSpec) -> str:
    return spec.install_hint if isinstance(spec.install_hint, str) else ""


def _no_hooks(plugin: Any) -> str:
    """Why a registered module contributes nothing (it implements none of the hooks)."""
    unmarked = [h for h in HOOKS.values() if callable(getattr(plugin, h, None))]
    if unmarked:
        return (f"defines no k3 hooks: {', '.join(unmarked)} is not marked; did you forget "
                "@hookimpl (from k3.plugin import hookimpl)?")
    return ("defines no k3 hooks; did you forget @hookimpl (from k3.plugin import hookimpl) "
            f"on one of {', '.join(HOOKS.values())}?")


def _installs_something_installed(hint: str) -> bool:
    """Whether ``hint`` is a ``pip install NAME ...`` of distributions all installed here."""
    words = hint.split()
    if len(words) < 3 or words[:2] != ["pip", "install"]:
        return False
    wanted = [w for w in words[2:] if not w.startswith("-")]
    if not wanted:
        return False
    for w in wanted:
        name = w.split("[")[0]
        for sep in ("==", ">=", "<=", "~=", ">", "<"):
            name = name.split(sep)[0]
        try:
            metadata.distribution(name)
        except (metadata.PackageNotFoundError, ValueError):
            return False
    return True


def _norm(dist: str) -> str:
    return dist.lower().replace("_", "-")


def _entry_points() -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=hookspecs.PROJECT))


_CACHED: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry (discovered once)."""
    global _CACHED
    if _CACHED is None or refresh:
        _CACHED = Registry.discover()
    return _CACHED
