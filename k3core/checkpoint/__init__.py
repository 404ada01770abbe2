"""The released checkpoint on disk: safetensors headers, the shard index, bounds.

May import: ``k3core.api``, ``k3core.model``.
"""
