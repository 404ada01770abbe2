"""The compiled window decoder of a high-byte codec (``bp-nib``, ``bp-bits``), loaded once.

Each codec's C decoder is an optional cffi module (built by ``setup.py`` through
``k3core/trunk/decoder_build.py`` where a C compiler is found) exporting
``PREFIX_decode(src, src_len, out, out_len, vector)`` and ``PREFIX_vector()``, the widest
join the CPU runs (0 is the portable loop). Where the module was not built the codec decodes
through NumPy instead, to the same bytes (:func:`decode_window`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class NativeDecoder:
    """One loaded decoder module: ``ffi``, ``lib``, and its decode and vector functions."""

    ffi: Any
    decode_fn: Any
    #: the widest join this CPU runs
    vector: int

    def decode(self, data: memoryview | np.ndarray | bytes, out: np.ndarray,
               vector: int | None = None) -> int:
        """Decode one window into ``out`` with the widest join, or with the join ``vector``
        names (the tests and the fuzz harness run each); 0 or the module's error code."""
        src = self.ffi.from_buffer(data)
        return int(self.decode_fn(src, len(src), self.ffi.from_buffer(out, require_writable=True),
                                  out.size, self.vector if vector is None else vector))


def load(module: str, prefix: str) -> NativeDecoder | None:
    """The compiled decoder in ``module`` (``k3core.trunk._k3nib``), or ``None`` where it was
    not built (callers cache the answer)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    lib = mod.lib
    return NativeDecoder(mod.ffi, getattr(lib, f"{prefix}_decode"),
                         int(getattr(lib, f"{prefix}_vector")()))


#: a codec's NumPy decoder: one window into ``out``, 0 or the refusal's error code
NumpyDecode = Callable[[memoryview | np.ndarray, np.ndarray], int]


def decode_window(native: NativeDecoder | None, numpy_decode: NumpyDecode,
                  data: memoryview | np.ndarray, out: np.ndarray) -> int:
    """Decode one window into ``out`` (uint8, exactly the raw length) through the compiled
    decoder where it was built (``native``), else through the codec's NumPy decoder: the
    same bytes and the same refusals either way. 0, or the refusal's error code."""
    return numpy_decode(data, out) if native is None else native.decode(data, out)
