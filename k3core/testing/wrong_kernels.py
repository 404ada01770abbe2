"""A deliberately wrong kernel backend: every op the numpy reference's except ``rmsnorm``,
whose sign it flips (the final norm then turns the logits' argmax into their argmin).

It is registered only in a test's process (:func:`register_wrong_kernels`), as a real plugin
through the registry, so whatever must refuse a backend that breaks the contract (``k3 tune``
keeping only settings whose ids match ``--backend numpy``; the kernel suite) is tested on a
real backend rather than a stand-in for k3.
"""

from __future__ import annotations

from typing import Any

from k3core.api.hookspecs import hookimpl
from k3core.api.kernels import F32, KernelBackend
from k3core.api.specs import KernelBackendSpec
from k3core.plugins.registry import Registry, get_registry
from k3core.testing.reference import reference_class

WRONG = "wrong-sign"


def _factory(threads: int = 1, **_: Any) -> Any:
    base = reference_class()

    def rmsnorm(self: KernelBackend, x: F32, w: F32 | None, eps: float) -> F32:
        return -base.rmsnorm(self, x, w, eps)

    wrong = type("WrongSignBackend", (base,), {"name": WRONG, "rmsnorm": rmsnorm})
    return wrong(threads)


class _WrongPlugin:
    @hookimpl
    def k3_kernel_backends(self) -> list[KernelBackendSpec]:
        return [KernelBackendSpec(name=WRONG, factory="k3core.testing.wrong_kernels:_factory",
                                  description="test-only: rmsnorm with the sign flipped",
                                  priority=-200)]


def register_wrong_kernels(reg: Registry | None = None) -> None:
    """Make ``--backend wrong-sign`` resolvable in this process (tests only)."""
    reg = reg or get_registry()
    if WRONG not in reg.names("kernel"):
        reg.add_plugin(_WrongPlugin(), "k3 tests (k3core.testing.wrong_kernels)", WRONG)


def unregister_wrong_kernels(reg: Registry | None = None) -> None:
    """Undo :func:`register_wrong_kernels`."""
    reg = reg or get_registry()
    reg.entries.get("kernel", {}).pop(WRONG, None)
    reg._probes.pop(("kernel", WRONG), None)
