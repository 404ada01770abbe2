"""cffi build script of the bp-nib codec's decoder: the compiled module ``k3core.trunk._k3nib``.

``setup.py`` names it in ``cffi_modules``, beside the avx2 backend's. It is plain C99 with
one SSSE3 function chosen at run time (``k3core/trunk/nibble.c``), so it builds with any C
compiler and runs on any CPU; like the avx2 module its build is optional: without it a
``bp-nib`` trunk still decodes, through NumPy (:mod:`k3core.trunk.nibble`), to the same
bytes, only slower.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
MODULE = "k3core.trunk._k3nib"


def make_ffibuilder() -> FFI:
    ffi = FFI()
    ffi.cdef((HERE / "nibble.h").read_text())
    ffi.set_source(
        MODULE,
        '#include "nibble.c"\n',
        include_dirs=[str(HERE)],
        extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3"],
        optional=True,  # a failed compile must not fail the install (setup.py)
        depends=[str(HERE / "nibble.c"), str(HERE / "nibble.h")],
    )
    return ffi


ffibuilder = make_ffibuilder()
