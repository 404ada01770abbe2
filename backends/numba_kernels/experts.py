"""The MXFP4 products of many matrices in one parallel region (the routed experts of a
decode step, one token each, or of a prefill chunk or a batched step, several each).

One token decoded alone sends each routed expert of a layer through three matrix products
and a SiTU, each a call of its own: on two threads the launches cost more than they share
(eight experts of [672 x 768] measured slower on two threads than on one). Here the rows of
every matrix of a stage are one ``prange``: the kernel reaches each matrix by the address
of its packed bytes and scale bytes (the caller keeps the arrays alive), and each row is
:func:`~k3_backends.numba_kernels.matmul.mx_row_t1`, the one-token kernel's own row, so
every output has the bits of the separate calls. Several tokens an expert go the same way
(:func:`_mxfp4_t4_many`): each matrix's rows two at a time against its own tokens, four at a
time, with the several-token kernel's own row pair (``matmul.py``'s ``mx_pair_tokens``), so a
prefill layer's 64 experts are three parallel regions instead of about 200 calls.
"""

from __future__ import annotations

import numpy as np
from k3_backends.numba_kernels.jit import LANE_SUM, twins
from k3_backends.numba_kernels.matmul import mx_pair_tokens, mx_row_t1
from k3_backends.numba_kernels.scratch import stack_f64
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


def _mxfp4_t4_many(addrs, rows, cols, xe, xo, xoff, tcount, which, ooff, out):
    """``out[which[m], ooff[m] + t, o]``: row ``o`` of matrix ``m`` (``rows x cols`` MXFP4 at
    ``addrs[m]``, as :func:`_mxfp4_t1_many`) against its token ``t < tcount[m]``, whose even
    and odd columns (float64) are row ``xoff[m] + t`` of ``xe``/``xo``; each matrix's tokens
    are padded with zero rows to a multiple of four there."""
    half, groups = cols // 2, cols // 32
    pairs = (rows + 1) // 2
    for i in prange(addrs.shape[0] * pairs):
        m = i // pairs
        oa = 2 * (i - m * pairs)
        ob = min(oa + 1, rows - 1)
        pa = carray(u8_at(addrs[m, 0] + oa * half), half)
        pb = carray(u8_at(addrs[m, 0] + ob * half), half)
        sa = carray(u8_at(addrs[m, 1] + oa * groups), groups)
        sb = carray(u8_at(addrs[m, 1] + ob * groups), groups)
        ev = carray(stack_f64(128), 128)
        od = carray(stack_f64(128), 128)
        mx_pair_tokens(pa, pb, sa, sb, xe, xo, xoff[m], tcount[m], groups, ev, od,
                       out[which[m], ooff[m] :], oa, ob)


mxfp4_t1_many = twins(_mxfp4_t1_many, **LANE_SUM)
mxfp4_t4_many = twins(_mxfp4_t4_many, **LANE_SUM)
