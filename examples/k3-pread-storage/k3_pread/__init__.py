"""``k3-pread-storage``: the ``pread`` storage backend, a worked example of a k3 storage plugin.

``pread`` reads every range with positional reads (``os.preadv``) straight into the caller's
buffer: one descriptor per open file, no shared file position, nothing kept once a read
returned. It shows the basics every storage backend needs (opening and sizing, range
checks, the short-read loop, stats, a safe ``close``), is written only against
:mod:`k3.plugin`, and its whole test file is one subclass of the shipped suite
(:class:`k3.testing.StorageConformance`). See ``docs/plugins.md`` in the k3 repository.
"""

from k3_pread.storage import PreadFile, PreadStorage

__all__ = ["PreadFile", "PreadStorage"]
