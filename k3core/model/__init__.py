"""The model as k3 computes it: config, tensor names, layer params, the forward pass,
sequence state, sampling, the decode loop and the sizes derived from a config.

May import: ``k3core.api``.
"""
