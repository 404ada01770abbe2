"""The one-token MXFP4 products of many matrices in one parallel region (the routed experts
of a decode step).

One token decoded alone sends each routed expert of a layer through three matrix products
and a SiTU, each a call of its own: on two threads the launches cost more than they share
(eight experts of [672 x 768] measured slower on two threads than on one). Here the rows of
every matrix of a stage are one ``prange``: the kernel reaches each matrix by the address
of its packed bytes and scale bytes (the caller keeps the arrays alive), and each row is
:func:`~k3_backends.numba_kernels.matmul.mx_row_t1`, the one-token kernel's own row, so
every output has the bits of the separate calls.
"""

from __future__ import annotations

import numpy as np
from k3_backends.numba_kernels.jit import LANE_SUM, twins
from k3_backends.numba_kernels.matmul import mx_row_t1
from llvmlite import ir
from numba import carray, prange, types
from numba.extending import intrinsic


@intrinsic
def u8_at(typingctx, addr):
    """The byte at address ``addr`` (an int64) as a ``uint8`` pointer, for :func:`carray`."""
    sig = types.CPointer(types.uint8)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.IntType(8)))

    return sig, codegen


def _mxfp4_t1_many(addrs, rows, cols, xe, xo, out):
    """``out[m, o]``: row ``o`` of matrix ``m`` (``rows x cols`` MXFP4, packed bytes at
    ``addrs[m, 0]``, scale bytes at ``addrs[m, 1]``) against token ``m`` of ``xe``/``xo``
    (its even and odd columns, float64), for every matrix at once."""
    half, groups = cols // 2, cols // 32
    for i in prange(addrs.shape[0] * rows):
        m = i // rows
        o = i - m * rows
        pr = carray(u8_at(addrs[m, 0] + o * half), half)
        sr = carray(u8_at(addrs[m, 1] + o * groups), groups)
        out[m, o] = np.float32(mx_row_t1(pr, sr, xe[m], xo[m]))


mxfp4_t1_many = twins(_mxfp4_t1_many, **LANE_SUM)
