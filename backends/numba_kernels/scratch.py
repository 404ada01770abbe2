"""Fixed-size float64 (and float32) scratch arrays on the stack, kept in registers by LLVM.

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


def _stack_intrinsic(name: str, ir_type: ir.Type, nb_type: types.Type) -> object:
    """The intrinsic ``name(size)``: a pointer to ``size`` (a compile-time constant)
    uninitialised slots of ``nb_type``."""

    def typer(typingctx, size):
        if not isinstance(size, types.IntegerLiteral):
            return None
        n = size.literal_value

        def codegen(context, builder, signature, args):
            return cgutils.alloca_once(builder, ir_type, size=n)

        return types.CPointer(nb_type)(size), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = f"A pointer to ``size`` (a compile-time constant) uninitialised {nb_type} slots."
    return intrinsic(typer)


stack_f64 = _stack_intrinsic("stack_f64", ir.DoubleType(), types.float64)
stack_f32 = _stack_intrinsic("stack_f32", ir.FloatType(), types.float32)
