"""The three plugin hooks of the ``k3`` entry-point group.

A plugin is any module (or object) registered under the ``k3`` entry-point group that
implements one or more of these hooks with ``@k3.plugin.hookimpl``. Built-in implementations
register exactly the same way a third party does. Each hook returns a list of spec records;
see ``docs/plugins.md`` for a complete example.
"""

from __future__ import annotations

import pluggy

from k3core.api.specs import CachePolicySpec, KernelBackendSpec, StorageBackendSpec

PROJECT = "k3"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def k3_kernel_backends() -> list[KernelBackendSpec]:  # type: ignore[empty-body]
    """Return the kernel backends this plugin provides (each conforming to the kernel contract)."""


@hookspec
def k3_storage_backends() -> list[StorageBackendSpec]:  # type: ignore[empty-body]
    """Return the storage backends this plugin provides (byte ranges into caller buffers)."""


@hookspec
def k3_cache_policies() -> list[CachePolicySpec]:  # type: ignore[empty-body]
    """Return the expert-cache eviction policies this plugin provides."""
