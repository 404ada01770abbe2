"""The routed experts: where each lives on disk, the slot cache (and its router-lookahead
reads), traces and the lookahead's guesses, the offline simulator.

May import: ``k3core.api``, ``k3core.plugins``, ``k3core.model``, ``k3core.checkpoint``.
"""
