"""``k3-flaky-storage``: the ``flaky`` storage backend, a worked example of a k3 storage plugin.

``flaky`` wraps another storage backend (``K3_FLAKY_INNER``, default ``plain``) and, on
request, makes every N-th read fail the way real disks do (half the buffer filled, then a
``StorageError``) or slows every read down: a tool for testing that code reading through k3
never hands on a failed read (``k3 run --storage flaky``). Configured by nothing it passes
the storage suite like the backend it wraps. See ``docs/plugins.md`` in the k3 repository.
"""

from k3_flaky.storage import FlakyStorage

__all__ = ["FlakyStorage"]
