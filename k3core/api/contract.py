"""The numeric constants of the bit-exact kernel contract, in one place.

Every backend (NumPy reference, Numba, C/AVX2, third-party plugins) must use exactly these
values; the C build and the Numba kernels import them from here. See
``docs/kernel-contract.md`` for the operations they define.
"""

from __future__ import annotations

import math

#: Number of float64 accumulation lanes in every long reduction. Element ``i`` goes to lane
#: ``i % LANES``; each lane adds its terms in increasing ``i`` starting from +0.0; then the
#: lanes are folded in halves (lane ``j`` += lane ``j + h`` for h = 16, 8, 4, 2, 1) and the
#: result is rounded once to float32 (or kept in float64 where an op says so).
LANES = 32

#: exp_d: x > EXP_HI gives +inf, x < EXP_LO gives +0.0 (both far outside float32 results).
EXP_HI = 709.0
EXP_LO = -708.0
LOG2E = float.fromhex("0x1.71547652b82fep+0")
#: ln 2 split so that n * LN2_HI is exact for |n| < 2**11.
LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
LN2_LO = math.log(2.0) - LN2_HI
#: Taylor coefficients 1/k! for exp_d's polynomial, k = 0..13 (Horner from the top).
EXP_COEF = tuple(1.0 / math.factorial(k) for k in range(14))
#: expm1_d uses its Taylor series below this magnitude, exp_d(x) - 1 above.
EXPM1_SERIES_MAX = 0.5
EXPM1_COEF = tuple(1.0 / math.factorial(k) for k in range(1, 18))  # 1/1! .. 1/17!
#: tanh_d(x) is +-1.0 beyond this magnitude (tanh(22) rounds to 1.0 in float64).
TANH_SAT = 22.0
#: L2 norm epsilon (inside the square root, added to the sum of squares).
L2_EPS = 1e-6
#: Router renormalisation epsilon (added to the float64 sum of the selected weights).
ROUTER_EPS = 1e-20

#: E2M1 code -> value; bit 3 is the sign; the low nibble of a byte is the even element.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: MXFP4 group size (one E8M0 scale byte per 32 inputs).
MXFP4_GROUP = 32


def e8m0_scale(byte: int) -> float:
    """E8M0 byte -> float64 scale 2**(byte-127); byte 255 (NaN by the OCP spec) -> 0.0."""
    return 0.0 if byte == 255 else math.ldexp(1.0, byte - 127)


E8M0 = tuple(e8m0_scale(b) for b in range(256))
