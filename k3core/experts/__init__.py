"""The routed experts: where each lives on disk, the slot cache, traces, the offline
simulator.

May import: ``k3core.api``, ``k3core.plugins``, ``k3core.model``, ``k3core.checkpoint``.
"""
