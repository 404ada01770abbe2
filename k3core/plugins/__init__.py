"""The plugin registry: the ``k3`` entry-point group, name resolution, availability.

May import: ``k3core.api``.
"""
