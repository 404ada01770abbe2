"""cffi build script of the bp-bits codec's decoder: the compiled module ``k3core.trunk._k3bits``.

``setup.py`` names it in ``cffi_modules``, beside the avx2 backend's and the ``bp-nib``
decoder's. It is plain C99 with an AVX2 and an AVX-512 join chosen at run time
(``k3core/trunk/bitcode.c``), so it builds with GCC or Clang and runs on any CPU; like the
avx2 module its build is optional: without it a ``bp-bits`` trunk still decodes, through
NumPy (:mod:`k3core.trunk.bitcode`), to the same bytes, only slower.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
MODULE = "k3core.trunk._k3bits"


def make_ffibuilder() -> FFI:
    ffi = FFI()
    ffi.cdef((HERE / "bitcode.h").read_text())
    ffi.set_source(
        MODULE,
        '#include "bitcode.c"\n',
        include_dirs=[str(HERE)],
        extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3"],
        optional=True,  # a failed compile must not fail the install (setup.py)
        depends=[str(HERE / "bitcode.c"), str(HERE / "bitcode.h")],
    )
    return ffi


ffibuilder = make_ffibuilder()
