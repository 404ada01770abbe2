"""The hook: one storage backend spec, and a probe for the one thing it needs."""

import os

from k3.plugin import Availability, StorageBackendSpec, hookimpl


def _probe() -> Availability:
    if not hasattr(os, "preadv"):
        return Availability.no("this platform has no os.preadv (positional reads)",
                               "use --storage plain or --storage mmap")
    return Availability.yes()


@hookimpl
def k3_storage_backends() -> list[StorageBackendSpec]:
    return [
        StorageBackendSpec(
            name="pread",
            factory="k3_pread.storage:PreadStorage",
            description="positional reads (preadv) into the caller's buffer (a worked example "
                        "of a storage plugin)",
            priority=-100,  # never chosen by `auto`
            probe=_probe,
        )
    ]
