"""A software prefetch for the jitted kernels: ``prefetch(a, i)`` asks for the cache line
holding ``a[i]`` of a 1-D array (LLVM's ``llvm.prefetch``: a read, locality 2, which x86
compiles to ``prefetcht1``, into L2).

A prefetch never faults, so ``i`` may run past the array's end (the last rows of a matrix
prefetch past it); nothing is read into the program and no result depends on it. The
one-token products use it to keep enough of the weight stream in flight: measured on a Zen 5
core, one thread, the bf16 product [12288 x 7168] read its rows at 11 GB/s with the hardware
prefetchers alone (docs/measurements/2026-12-02-zen5.md).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I32 = ir.IntType(32)


@intrinsic
def prefetch(typingctx, arr, idx):
    """Prefetch the line of ``arr[idx]`` (``arr`` a 1-D array, ``idx`` an integer)."""
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(idx, types.Integer):
        return None
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        base = builder.ptrtoint(ary.data, ir.IntType(64))
        step = context.get_abi_sizeof(context.get_data_type(signature.args[0].dtype))
        i64 = ir.IntType(64)
        idx64 = args[1]
        if idx64.type.width < 64:
            idx64 = (builder.sext if signature.args[1].signed else builder.zext)(idx64, i64)
        off = builder.mul(idx64, ir.Constant(i64, step))
        ptr = builder.inttoptr(builder.add(base, off), ir.IntType(8).as_pointer())
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen
