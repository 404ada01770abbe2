"""Spec records: what a plugin tells the registry about one implementation.

A plugin's hook returns a list of these. Nothing is imported or built until the registry
resolves a name: ``factory`` is a ``"package.module:Attribute"`` string loaded lazily, and
``probe`` is a cheap check (cached by the registry) that says whether the implementation can
run on this machine and, if not, why and how to fix it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["kernel", "storage", "cache"]


@dataclass(frozen=True)
class Availability:
    """Result of a probe: ``ok``, or the reason it cannot run and the fix."""

    ok: bool
    reason: str = ""
    hint: str = ""

    @classmethod
    def yes(cls) -> Availability:
        return cls(True)

    @classmethod
    def no(cls, reason: str, hint: str = "") -> Availability:
        return cls(False, reason, hint)


def _always() -> Availability:
    return Availability.yes()


@dataclass(frozen=True)
class PluginSpec:
    """Common fields of every spec record."""

    name: str
    factory: str
    description: str = ""
    priority: int = 0
    probe: Callable[[], Availability] = field(default=_always, compare=False)
    install_hint: str = ""

    kind: Kind = "kernel"

    def load(self) -> Any:
        """Import and return the factory object (a class or a callable)."""
        module_name, _, attr = self.factory.partition(":")
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        return obj


@dataclass(frozen=True)
class KernelBackendSpec(PluginSpec):
    """A kernel backend: the factory builds a :class:`k3core.api.kernels.KernelBackend`."""

    kind: Kind = "kernel"


@dataclass(frozen=True)
class StorageBackendSpec(PluginSpec):
    """A storage backend: the factory builds a :class:`k3core.api.storage.StorageBackend`.

    ``probe`` says whether it runs on this machine; whether it can read the files of one
    model directory is its class's :meth:`~k3core.api.storage.StorageBackend.probe_path`
    (the registry asks it when ``auto`` picks a backend for a path)."""

    kind: Kind = "storage"


@dataclass(frozen=True)
class CachePolicySpec(PluginSpec):
    """An expert-cache policy: the factory builds a :class:`k3core.api.cache_policy.CachePolicy`."""

    kind: Kind = "cache"
