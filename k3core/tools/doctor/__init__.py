"""``k3 doctor``: can this machine run the model, and what to type next.
"""
