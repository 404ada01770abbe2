"""Fixed-size float64 (and float32) scratch arrays on the stack, for accumulators LLVM can keep in registers.

A ``np.zeros`` array lives on the heap and LLVM cannot prove that the kernel's other loads do
not alias it, so it stores the accumulators back to memory on every iteration. An ``alloca``
of a constant size that never escapes is promoted to registers. Use :func:`stack_f64` only
directly inside a kernel body (never return it from a helper): the memory belongs to the
frame of the function it is inlined into, and it is not zeroed.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def stack_f64(typingctx, size):
    """A pointer to ``size`` (a compile-time constant) uninitialised float64 slots."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    n = size.literal_value

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, ir.DoubleType(), size=n)

    return types.CPointer(types.float64)(size), codegen


@intrinsic
def stack_f32(typingctx, size):
    """A pointer to ``size`` (a compile-time constant) uninitialised float32 slots."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    n = size.literal_value

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=n)

    return types.CPointer(types.float32)(size), codegen
