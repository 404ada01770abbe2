"""Built-in kernel backends (import name ``k3_backends``): numpy (the reference), numba, avx2."""
