"""k3: run Kimi K3 from its released checkpoint layout, bit-exactly, at any memory budget.

This package is k3's public Python face (``docs/python-api.md``)::

    import k3

    engine = k3.load("model-dir")                 # opened once, reused for every call
    out = engine.generate("Hello", max_tokens=8)  # .text, .ids, .report
    for piece in engine.stream("Hello", max_tokens=8):
        print(piece, end="")
    chat = engine.session()                       # carries KV and recurrent state
    chat.generate("Hi", max_tokens=4)
    chat.save("chat.k3s")

Plugins import from :mod:`k3.plugin` and :mod:`k3.testing`; everything under ``k3core`` is
internal and may move between releases. ``import k3`` loads no numeric library; ``load``
does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from k3core import __version__
from k3core.api.errors import (
    CheckpointError,
    ConfigError,
    ExpertDropError,
    K3Error,
    MemoryPlanError,
    OutputError,
    PluginError,
    StorageError,
    TokenizerError,
    UsageError,
)

if TYPE_CHECKING:
    from k3core.run.engine import Engine
    from k3core.run.generation import Generation
    from k3core.run.request import GenerationParams
    from k3core.run.session import Session
    from k3core.run.state_file import StateFileError

__all__ = [
    "CheckpointError", "ConfigError", "Engine", "ExpertDropError", "Generation",
    "GenerationParams", "K3Error", "MemoryPlanError", "OutputError", "PluginError", "Session",
    "StateFileError", "StorageError", "TokenizerError", "UsageError", "__version__", "load",
]

_LAZY = {
    "Engine": "k3core.run.engine",
    "Session": "k3core.run.session",
    "Generation": "k3core.run.generation",
    "GenerationParams": "k3core.run.request",
    "StateFileError": "k3core.run.state_file",
}


def load(
    model_dir: str | os.PathLike[str],
    *,
    preset: str | None = None,
    trunk: str | os.PathLike[str] | None = None,
    backend: str | None = None,
    storage: str | None = None,
    cache_policy: str | None = None,
    threads: int | None = None,
    **options: Any,
) -> Engine:
    """Open the model in ``model_dir`` once and return the :class:`Engine`.

    The keywords are ``k3 run``'s flags with the same meaning and precedence (a keyword beats
    ``$K3_*`` beats the preset beats the default): ``preset``, ``trunk`` (a packed trunk to
    stream), ``backend``, ``storage``, ``cache_policy``, ``threads``, and in ``options``
    ``trunk_gb``, ``trunk_ring``, ``cache_gb``, ``ultra_low_memory``, ``prefill_chunk``, ``tok``,
    ``config``, ``layers``, ``incremental`` (default True), ``cache_trace``, ``verify_trunk``,
    ``lookahead`` (``"off"``, the default, ``"on"``, ``"attn"``, ``"out"``), ``expert_readers``. The memory
    plan is checked before anything large is allocated. Raises a :class:`K3Error`.
    """
    from k3core.run.engine import open_engine
    from k3core.run.request import EngineRequest, build

    fields = {"model_dir": os.fspath(model_dir), "preset": preset, "trunk": trunk,
              "backend": backend, "storage": storage, "cache_policy": cache_policy,
              "threads": threads, **options}
    known = EngineRequest.options()
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise UsageError(f"k3.load: unknown option(s) {', '.join(unknown)}; known: "
                         f"{', '.join(known)}")
    given = {k: v for k, v in fields.items() if v is not None}
    return open_engine(build(EngineRequest, {**given, "given_as": "keyword"}))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'k3' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
