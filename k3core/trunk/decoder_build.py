"""cffi build script of the high-byte codecs' compiled window decoders.

``setup.py`` names its two builders in ``cffi_modules``, beside the avx2 backend's:

* ``nibble``: the ``bp-nib`` decoder, the compiled module ``k3core.trunk._k3nib``, from
  ``k3core/trunk/nibble.c`` (plain C99 with one SSSE3 join chosen at run time);
* ``bitcode``: the ``bp-bits`` decoder, the compiled module ``k3core.trunk._k3bits``, from
  ``k3core/trunk/bitcode.c`` (plain C99 with an AVX2 and an AVX-512 join chosen at run time).

Each builds with GCC or Clang and runs on any CPU. Like the avx2 module, each build is
optional: without it a trunk of that codec still decodes, through NumPy
(:mod:`k3core.trunk.nibble`, :mod:`k3core.trunk.bitcode`), to the same bytes, only slower.
cffi runs this file by path at build time, so it imports nothing of k3's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def decoder_builder(stem: str, module: str) -> FFI:
    """The builder of the decoder in ``STEM.c``, declared by ``STEM.h`` (cffi reads the
    header as its cdef), as the compiled module ``module``."""
    ffi = FFI()
    ffi.cdef((HERE / f"{stem}.h").read_text())
    ffi.set_source(
        module,
        f'#include "{stem}.c"\n',
        include_dirs=[str(HERE)],
        extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3"],
        optional=True,  # a failed compile must not fail the install (setup.py)
        depends=[str(HERE / f"{stem}.c"), str(HERE / f"{stem}.h")],
    )
    return ffi


def nibble() -> FFI:
    """The ``bp-nib`` decoder's builder (``setup.py``: ``decoder_build.py:nibble``)."""
    return decoder_builder("nibble", "k3core.trunk._k3nib")


def bitcode() -> FFI:
    """The ``bp-bits`` decoder's builder (``setup.py``: ``decoder_build.py:bitcode``)."""
    return decoder_builder("bitcode", "k3core.trunk._k3bits")
