"""The packed trunk: pack, manifest, budget split, the pinned set + ring stream, the
streamed tables of ultra-low-memory mode, and opening a run's trunk source.

May import: ``k3core.api``, ``k3core.model``, ``k3core.checkpoint``.
"""
