"""The stable API for writing k3 plugins (kernel backends, storage backends, cache policies).

A plugin imports only from here and from :mod:`k3.testing`; everything under ``k3core`` is
internal and may move between releases. A complete plugin module::

    from k3.plugin import KernelBackendSpec, hookimpl

    @hookimpl
    def k3_kernel_backends():
        return [KernelBackendSpec(name="mine", factory="my_pkg.backend:MyBackend")]

registered in the plugin's ``pyproject.toml`` under ``[project.entry-points.k3]``. See
``docs/plugins.md`` for a walk-through of each kind.

What is here:

* registration: :data:`hookimpl`, the spec records :class:`KernelBackendSpec`,
  :class:`StorageBackendSpec`, :class:`CachePolicySpec`, and :class:`Availability` (a probe's
  answer);
* the three contracts: :class:`KernelBackend` (with :class:`Mxfp4`, the array aliases
  ``F32``/``U16`` and the kernel contract's constants: :data:`LANES`, module :mod:`contract`;
  :func:`latent_shapes`, the checked shapes of an ``mla_latent_attention`` call, and
  :func:`force_parallel_from_env`, the ``K3_FORCE_PARALLEL`` switch),
  :class:`StorageBackend` (with :class:`StorageFile`, :class:`IOStats`, :class:`IOTimer`,
  :func:`byte_view`, :func:`checked_destination`, :func:`aligned_empty`, k3's one alignment
  :data:`ALIGN` and :func:`align_up`; the storage contract is written on these classes:
  ``help(k3.plugin.StorageFile)``), :class:`CachePolicy` (with the key helpers
  :func:`make_key`, :func:`key_layer`, :func:`key_expert`, and for a policy that reads a
  recorded run: :func:`read_trace`, :func:`trace_keys`, :func:`next_use`);
* :class:`NumpyBackend`, the reference kernel backend, to extend or to compare with;
  :data:`MODEL_SIZES`, the named model shapes (``k3 synth --size``, and ``real``: Kimi K3),
  to measure a plugin at;
* the errors a plugin raises: :class:`K3Error`, :class:`UsageError`, :class:`PluginError`,
  :class:`StorageError`;
* :func:`create` and :func:`available`, to build another registered implementation (a
  wrapper plugin) without touching the registry's internals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k3core.api import contract
from k3core.api.cache_policy import (
    EXPERT_MASK,
    KEY_SHIFT,
    CachePolicy,
    key_expert,
    key_layer,
    make_key,
)
from k3core.api.contract import LANES
from k3core.api.errors import K3Error, PluginError, StorageError, UsageError
from k3core.api.hookspecs import hookimpl
from k3core.api.kernels import (
    F32,
    U8,
    U16,
    KdaSeq,
    KdaWeights,
    KernelBackend,
    MlaSeq,
    MlaWeights,
    Mxfp4,
    force_parallel_from_env,
    latent_shapes,
)
from k3core.api.specs import (
    Availability,
    CachePolicySpec,
    KernelBackendSpec,
    Kind,
    PluginSpec,
    StorageBackendSpec,
)
from k3core.api.storage import (
    Buffer,
    IOStats,
    IOTimer,
    StorageBackend,
    StorageFile,
    aligned_empty,
    byte_view,
    checked_destination,
)
from k3core.api.units import ALIGN, align_up
from k3core.model.shapes import SIZES as MODEL_SIZES

if TYPE_CHECKING:  # imported on first use: the reference backend itself imports this module
    from k3_backends.numpy_backend import NumpyBackend

    from k3core.experts.simulator import next_use  # and these load the trace readers
    from k3core.experts.trace import read_trace, trace_keys

__all__ = [
    "ALIGN", "EXPERT_MASK", "F32", "KEY_SHIFT", "LANES", "MODEL_SIZES", "U8", "U16",
    "Availability", "Buffer", "CachePolicy", "CachePolicySpec", "IOStats", "IOTimer", "K3Error",
    "KdaSeq", "KdaWeights", "KernelBackend", "MlaSeq", "MlaWeights", "KernelBackendSpec", "Kind", "Mxfp4", "NumpyBackend", "PluginError",
    "PluginSpec", "StorageBackend", "StorageBackendSpec", "StorageError", "StorageFile",
    "UsageError",
    "align_up", "aligned_empty", "available", "byte_view", "checked_destination", "contract",
    "create", "force_parallel_from_env", "hookimpl", "key_expert", "key_layer",
    "latent_shapes", "make_key", "next_use", "read_trace", "trace_keys",
]


def create(kind: Kind, name: str, **options: Any) -> Any:
    """Build the registered ``kind`` implementation ``name`` (``"auto"``: the best available)
    with ``options`` (kernel backends: ``threads=``; cache policies: ``capacity=``, ...).

    Raises :class:`PluginError` with the reason and the fix when it cannot run here.
    """
    from k3core.plugins.registry import get_registry

    instance, _, _ = get_registry().create(kind, name, **options)
    return instance


def available(kind: Kind) -> list[str]:
    """The names of the ``kind`` implementations that can run here, best first (the order
    ``auto`` tries them in)."""
    from k3core.plugins.registry import get_registry

    return get_registry().available(kind)


def __getattr__(name: str) -> Any:
    if name == "NumpyBackend":
        from k3_backends.numpy_backend import NumpyBackend

        return NumpyBackend
    if name in ("read_trace", "trace_keys"):
        from k3core.experts import trace

        return getattr(trace, name)
    if name == "next_use":
        from k3core.experts.simulator import next_use

        return next_use
    raise AttributeError(f"module 'k3.plugin' has no attribute {name!r}")
