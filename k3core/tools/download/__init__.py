"""``k3 download``: a pinned, verified, resumable download from the Hub.
"""
