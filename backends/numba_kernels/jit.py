"""Compilation options of every kernel, and parallel/serial twins of the parallel ones.

``JIT``: ``cache=True`` (machine code kept on disk), ``fastmath=False`` (no FMA contraction,
no reassociation: the contract's rounding), ``nogil=True`` (readers run beside the
kernels), ``error_model="numpy"`` (a division by zero gives inf, as in NumPy).

A parallel kernel (``prange`` over independent outputs) comes as :class:`Twins`: the
``parallel`` build, and a ``serial`` build of the same source in which ``prange`` is a plain
``range``. The backend launches the serial one when a kernel gets a single thread, so a
small kernel never pays for a thread hand-off. The serial build is compiled from a copy of
the function with its own ``__qualname__``: Numba's disk cache tells functions apart by
name and line, not by options, and would otherwise hand one build's machine code to the
other.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

from numba import njit

JIT: dict[str, Any] = dict(cache=True, fastmath=False, nogil=True, error_model="numpy")
PAR: dict[str, Any] = dict(JIT, parallel=True)
#: The matrix products' lane sums only: LLVM may contract ``acc + x * w`` into an FMA. The
#: product of a float32 by a bf16, float32 or MXFP4 value is exact in float64, so one
#: rounding of the sum is what the separate multiply and add give (docs/kernel-contract.md
#: section 2); nothing else in those kernels multiplies and then adds.
LANE_SUM: dict[str, Any] = dict(fastmath={"contract"})


class Twins(NamedTuple):
    """The two builds of one parallel kernel."""

    parallel: Any
    serial: Any


def twins(fn: Callable[..., Any], **extra: Any) -> Twins:
    """Compile ``fn`` (a plain function using ``prange``) both parallel and serial
    (``extra`` options, such as :data:`LANE_SUM`, go to both builds)."""
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__
    )
    copy.__qualname__ = fn.__qualname__ + "_serial"
    copy.__doc__ = fn.__doc__
    copy.__module__ = fn.__module__
    return Twins(njit(**dict(PAR, **extra))(fn), njit(**dict(JIT, **extra))(copy))
