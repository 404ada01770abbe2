"""``k3-timing-backend``: the ``timed`` kernel backend, a worked example of a k3 plugin.

``timed`` wraps another kernel backend (``K3_TIMED_INNER``, default: the best available one)
and records, per op, the number of calls, the seconds spent and the bytes of array inputs
read. It is bit-identical to the wrapped backend by construction: every op is a plain
delegation. See ``docs/plugins.md`` in the k3 repository.
"""

from k3_timing.backend import TimedBackend
from k3_timing.stats import OpStats

__all__ = ["OpStats", "TimedBackend"]
