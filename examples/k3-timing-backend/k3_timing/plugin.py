"""The entry point of ``k3-timing-backend``: one hook returning one spec record."""

from __future__ import annotations

import os

from k3.plugin import Availability, KernelBackendSpec, hookimpl


def _probe() -> Availability:
    """Cheap: refuse only the one configuration that can never work (wrapping itself)."""
    if os.environ.get("K3_TIMED_INNER", "") == "timed":
        return Availability.no(
            "K3_TIMED_INNER=timed would wrap the timed backend in itself",
            "set K3_TIMED_INNER to numpy, numba or avx2 (or unset it for the best available)",
        )
    return Availability.yes()


@hookimpl
def k3_kernel_backends() -> list[KernelBackendSpec]:
    return [
        KernelBackendSpec(
            name="timed",
            factory="k3_timing.backend:TimedBackend",
            description="wraps another kernel backend ($K3_TIMED_INNER) and times every op",
            priority=-100,  # never chosen by `auto` while a real backend is available
            probe=_probe,
            install_hint="pip install k3-timing-backend",
        )
    ]
