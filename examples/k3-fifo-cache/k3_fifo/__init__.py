"""``k3-fifo-cache``: the ``fifo`` expert-cache policy, a worked example of a k3 cache plugin.

``fifo`` evicts the expert that entered the cache first; a hit changes nothing. It is written
only against :mod:`k3.plugin` and proves itself with the suites of :mod:`k3.testing`. See
``docs/plugins.md`` in the k3 repository.
"""

from k3_fifo.policy import FIFOPolicy

__all__ = ["FIFOPolicy"]
