"""``k3 bench``: kernels beside memory bandwidth, storage beside raw O_DIRECT, the memory ladder.
"""
