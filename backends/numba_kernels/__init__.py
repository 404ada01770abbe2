"""Numba kernels of the ``numba`` backend, one module per family of ops.

``bits`` (weight decoders as LLVM intrinsics), ``scratch`` (stack accumulators), ``exact``
(the contract's scalar primitives), ``matmul``, ``pointwise``, ``recurrent``, ``attention``
and ``router``. Every kernel is compiled with ``cache=True``: machine code is stored next
to these files in ``__pycache__`` (or under ``NUMBA_CACHE_DIR``) and reused by later
processes; ``cache`` drops it when any of these sources changes (Numba alone would only
notice a change to the kernel's own file, not to the primitives compiled into it).
"""
