"""``k3 synth``: deterministic synthetic checkpoints in the released layout.
"""
