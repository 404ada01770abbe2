"""The hook: one storage backend spec."""

import os

from k3.plugin import Availability, StorageBackendSpec, hookimpl


def _probe() -> Availability:
    if os.environ.get("K3_FLAKY_INNER", "") == "flaky":
        return Availability.no("K3_FLAKY_INNER=flaky would wrap the flaky backend in itself",
                               "set K3_FLAKY_INNER to plain, mmap or direct")
    return Availability.yes()


@hookimpl
def k3_storage_backends() -> list[StorageBackendSpec]:
    return [
        StorageBackendSpec(
            name="flaky",
            factory="k3_flaky.storage:FlakyStorage",
            description="wraps another storage backend ($K3_FLAKY_INNER) and injects read "
                        "failures ($K3_FLAKY_FAIL_EVERY) and delays ($K3_FLAKY_DELAY_MS)",
            priority=-100,  # never chosen by `auto`
            probe=_probe,
        )
    ]
