"""Adversarial kernel inputs: where the contract's order of summation and its own ``exp`` show.

Random inputs almost never tell a lane sum from ``np.sum`` or a sequential float64 sum, and
never tell ``exp_d`` from a library ``exp``: the float64 results differ by a few ulps and the
final rounding to float32 hides that. Two constructions make the difference visible:

* **cancellation** (signed reductions: matrix products, attention and AttnRes scores and
  mixtures, the KDA recurrence): ``+big`` at term 0, ``small`` at term 16, ``-big`` at term 32 sum to
  ``small`` in the contract's 32 lanes and to 0 sequentially, pairwise (``np.sum``), in
  float32 or in 16 lanes; ``+big`` at 0, ``small`` at 32, ``-big`` at 64 give 0 in 32 lanes
  and ``small`` in 64 lanes;
* **a float32 rounding boundary** (sums of positive terms and transcendentals: RMSNorm, L2
  norm, softmax denominators, the router's renormalisation, ``kda_gate``, SiTU): a knob of the input (an element, or a
  float64 parameter such as ``lower_bound``) is bisected *with the reference backend* until
  one output element sits between two adjacent float32 values; the knob's two neighbouring
  values then give outputs on either side of a rounding midpoint, so any backend whose
  float64 value before rounding is off by more than the knob's step, in either direction,
  returns a different float32 at one of them. Knobs are staged coarse to fine, so the final
  step is below one float64 ulp of the quantity that is rounded. Where a library ``exp`` is
  the mistake to expose, only boundaries where a correctly rounded ``exp`` lands on the
  other side of the midpoint are kept (checked with :mod:`decimal`, 60 digits).

Everything is built from the reference backend and seeded constants; nothing is read from
disk. :func:`cases` returns the cases of one op as ``(label, args)``.
"""

from __future__ import annotations

import decimal
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from k3core.api.kernels import KernelBackend, Mxfp4
from k3core.testing.reference import exp_d, reference

Case = tuple[str, tuple[Any, ...]]

BIG = np.float32(2.0**60)
SMALL = np.float32(1.0)
#: (position of +big, position of the small term, position of -big) and which orders they expose
CANCEL_PATTERNS = {
    "0/16/32": (0, 16, 32),  # 32 lanes: small; sequential, np.sum, float32, 16 lanes: 0
    "0/32/64": (0, 32, 64),  # 32 lanes: 0; 64 lanes: small
}


# ---- ordering floats as integers (for bisection) ----------------------------------------
def _key(v: float, dtype: type) -> int:
    """A monotone integer key of a float (adjacent floats have adjacent keys)."""
    it = np.int32 if dtype is np.float32 else np.int64
    b = int(np.array(v, dtype=dtype).view(it))
    return b if b >= 0 else -(b & (1 << (np.dtype(it).itemsize * 8 - 1)) - 1) - 1


def _unkey(k: int, dtype: type) -> float:
    it = np.int32 if dtype is np.float32 else np.int64
    b = k if k >= 0 else (-k - 1) | (1 << (np.dtype(it).itemsize * 8 - 1))
    if b >= 1 << (np.dtype(it).itemsize * 8 - 1):
        b -= 1 << (np.dtype(it).itemsize * 8)
    return float(np.array(b, dtype=it).view(dtype))


def flip(watch: Callable[[float], int], lo: float, hi: float, dtype: type = np.float64
         ) -> tuple[float, float] | None:
    """Adjacent ``dtype`` values ``a < b`` in ``[lo, hi]`` with ``watch(a) != watch(b)``;
    None when ``watch(lo) == watch(hi)``."""
    klo, khi = _key(lo, dtype), _key(hi, dtype)
    wlo = watch(_unkey(klo, dtype))
    if watch(_unkey(khi, dtype)) == wlo:
        return None
    while khi - klo > 1:
        mid = (klo + khi) // 2
        if watch(_unkey(mid, dtype)) == wlo:
            klo = mid
        else:
            khi = mid
    return _unkey(klo, dtype), _unkey(khi, dtype)


def staged(watch: Callable[[list[float]], int], stages: Sequence[tuple[float, float]],
           dtype: type = np.float32) -> tuple[list[float], list[float]] | None:
    """Bisect knob after knob (coarse to fine): each knob starts at its ``lo``; once a knob's
    flip is found it stays on the near side and the next, finer knob crosses the rest of the
    way. Returns the knob values on both sides of the last flip found."""
    values = [lo for lo, _ in stages]
    best: tuple[list[float], list[float]] | None = None
    for i, (lo, hi) in enumerate(stages):
        def one(v: float, i: int = i) -> int:
            return watch(values[:i] + [v] + values[i + 1:])

        pair = flip(one, lo, hi, dtype)
        if pair is None:
            break
        a, b = pair
        values[i] = a
        best = (list(values), values[:i] + [b] + values[i + 1:])
    return best


def bits(a: Any, index: int = 0) -> int:
    """The raw word of one element of a float32 result (the thing a boundary flips)."""
    return int(np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)[index])


# ---- correctly rounded references (decimal, 60 digits) -----------------------------------
_CTX = decimal.Context(prec=60)


def exp_cr(x: float) -> float:
    """``exp(x)`` correctly rounded to float64."""
    return float(_CTX.exp(decimal.Decimal(x)))


def f32_cr_exp(x: float) -> np.float32:
    """``exp(x)`` correctly rounded to float32 (straight from the 60-digit value)."""
    t = _CTX.exp(decimal.Decimal(x))
    r = np.float32(float(t))
    lo, hi = np.nextafter(r, np.float32(-np.inf)), np.nextafter(r, np.float32(np.inf))
    if t < (decimal.Decimal(float(lo)) + decimal.Decimal(float(r))) / 2:
        return lo
    if t > (decimal.Decimal(float(r)) + decimal.Decimal(float(hi))) / 2:
        return hi
    return r


# ---- the reference -----------------------------------------------------------------------
def _ref() -> KernelBackend:
    return reference()


def _quiet(fn: Callable[..., Any], *args: Any) -> Any:
    with np.errstate(all="ignore"):
        return fn(*args)


# ---- sums of positive terms: RMSNorm and the L2 norm ------------------------------------
def _norm_row(n: int, big_at: int) -> np.ndarray:
    """A power-of-two ``64`` among ``2**-21`` terms: each small square is a quarter ulp of
    the running sum, so every order loses a different number of them."""
    x = np.full(n, np.float32(2.0**-21), dtype=np.float32)
    x[big_at] = np.float32(64.0)
    return x


def _norm_cases(op: str, widths: Sequence[int]) -> list[Case]:
    out: list[Case] = []
    for n in widths:
        for big_at in (0, n // 2 + 1):
            c, f = (big_at + 5) % n, (big_at + 40) % n  # the coarse and the fine knob
            row = _norm_row(n, big_at)

            def build(v: list[float], row: np.ndarray = row, c: int = c, f: int = f) -> tuple[Any, ...]:
                x = row.copy()
                x[c], x[f] = v
                return (x[None, :], None, 1e-6) if op == "rmsnorm" else (x[None, :],)

            def watch(v: list[float], build: Any = build, big_at: int = big_at) -> int:
                return bits(_quiet(getattr(_ref(), op), *build(v)), big_at)

            found = staged(watch, [(0.0, 2.0**-4), (0.0, 2.0**-14)])
            if found is None:
                continue
            for side, v in zip(("below", "above"), found, strict=True):
                out.append((f"{op} n={n} big@{big_at} {side}", build(v)))
    return out


# ---- cancellation: signed reductions -----------------------------------------------------
def _cancel_vector(n: int, pattern: tuple[int, int, int], sign_big: float = 1.0) -> np.ndarray:
    a, s, b = pattern
    x = np.zeros(n, dtype=np.float32)
    x[a], x[s], x[b] = BIG * np.float32(sign_big), SMALL, -BIG * np.float32(sign_big)
    return x


def _matmul_cases() -> list[Case]:
    out: list[Case] = []
    rng = np.random.default_rng(1717)
    for name, pat in CANCEL_PATTERNS.items():
        for cols in (96, 128, 3584):
            x = np.stack([_cancel_vector(cols, pat), -_cancel_vector(cols, pat)])
            x[:, pat[1]] = np.float32(3.0)  # the small term stays positive in both rows
            ones = np.ones((3, cols), dtype=np.float32)
            ones[1] = -1.0
            f32w = ones.copy()
            f32w[2] = rng.choice(np.array([0.5, 1.0, 2.0], dtype=np.float32), cols)
            out.append((f"matmul_f32 cancel {name} cols={cols}", (f32w, x)))
            bf = (f32w.view(np.uint32) >> 16).astype(np.uint16)
            out.append((f"matmul_bf16 cancel {name} cols={cols}", (bf, x)))
            code = np.where(f32w < 0, 10, np.where(f32w == 0.5, 1, np.where(f32w == 2.0, 4, 2)))
            packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
            scales = np.full((3, cols // 32), 127, dtype=np.uint8)
            out.append((f"matmul_mxfp4 cancel {name} cols={cols}", (Mxfp4(packed, scales), x)))
    return out


def _attn_res_cases() -> list[Case]:
    """The mixture (every score 0, sources cancelling) and the score's dot product: source 0
    is ``[B, 1, -B]`` at the pattern's columns, so its key is ``[k, k/B, -k]``; the fold
    ``[2**54, 2**60, 2**54]`` makes the terms ``[+2**56, 4, -2**56]``: a score of 4 in the
    contract's lanes (source 0 dominates the softmax), 0 in the orders it forbids."""
    out: list[Case] = []
    for name, pat in CANCEL_PATTERNS.items():
        E, S = pat[2] + 1, 9
        src = np.zeros((S, 2, E), dtype=np.float32)
        src[0, :] = _cancel_vector(E, pat)
        src[3, 1, :] = np.float32(1.0)  # another source, scored by the fold too
        fold = np.zeros(E, dtype=np.float32)
        fold[[pat[0], pat[2]]] = np.float32(2.0**54)
        fold[pat[1]] = np.float32(2.0**60)
        out.append((f"attn_res score cancel {name}", (src, fold, 1e-6)))
    for name, pat in CANCEL_PATTERNS.items():
        S, E = pat[2] + 1, 33
        src = np.zeros((S, 1, E), dtype=np.float32)
        src[:, 0, 1] = np.float32(1.0)  # keys stay finite; with fold = 0 every score is 0
        for i in range(E):
            src[:, 0, i] += _cancel_vector(S, pat, 1.0 if i % 2 else -1.0)
        fold = np.zeros(E, dtype=np.float32)
        out.append((f"attn_res mixture cancel {name}", (src, fold, 1e-6)))
    return out


def _kda_recurrent_cases() -> list[Case]:
    """The output sum (``k = 0`` keeps the all-ones state, ``q`` cancels) and the state
    update's sum (``k`` cancels, so ``u`` and the state written back differ)."""
    out: list[Case] = []
    for name, pat in CANCEL_PATTERNS.items():
        D = max(128, pat[2] + 1)
        ones = np.ones((1, 1, D), dtype=np.float32)
        beta = np.full((1, 1), np.float32(0.5), dtype=np.float32)
        q = _cancel_vector(D, pat)[None, None, :]
        k = _cancel_vector(D, pat)[None, None, :] * np.float32(2.0**-20)
        zero = np.zeros((1, 1, D), dtype=np.float32)
        state = np.ones((1, D, D), dtype=np.float32)
        out.append((f"kda_recurrent output sum cancel {name}", (q, zero, ones, ones, beta, state)))
        out.append((f"kda_recurrent state sum cancel {name}", (zero, k, ones, ones, beta, state)))
    return out


# ---- exp at float32 boundaries --------------------------------------------------------------
def _kda_gate_cases(want: int = 8) -> list[Case]:
    """``z + dt = 0`` makes ``sig_d(...) = 1/2`` exactly, so ``alpha = f32(exp_d(lb / 2))``
    with ``lb`` free in float64: bisect ``lb`` to a rounding boundary where a correctly
    rounded exp lands on the other side."""
    out: list[Case] = []
    z = np.zeros((1, 33), dtype=np.float32)
    dt = np.zeros(33, dtype=np.float32)
    a_log = np.zeros(1, dtype=np.float32)
    rng = np.random.default_rng(31)
    for _ in range(400):
        lo = float(rng.uniform(-5.0, -0.05))
        hi = lo + 1e-6

        def watch(lb: float) -> int:
            return bits(_ref().kda_gate(z, dt, a_log, lb))

        pair = flip(watch, lo, hi)
        if pair is None:
            continue
        for lb in pair:
            ref = _ref().kda_gate(z, dt, a_log, lb)[0, 0]
            if f32_cr_exp(lb * 0.5) != ref:
                out.append((f"kda_gate lb={lb!r}", (z, dt, a_log, lb)))
        if len(out) >= want:
            break
    return out


def _situ_cases(want: int = 8) -> list[Case]:
    """``g`` where ``exp_d(-g)`` is not the correctly rounded exp (so a library exp changes
    ``sig_d(g)``), then ``b2`` bisected until the product sits at a rounding boundary."""
    out: list[Case] = []
    rng = np.random.default_rng(37)
    u = np.full(33, np.float32(1.5), dtype=np.float32)
    tried = 0
    while len(out) < want and tried < 400:
        tried += 1
        g0 = np.float32(rng.uniform(-6.0, 3.0))
        if float(exp_d(np.float64(-g0))) == exp_cr(-float(g0)):
            continue
        g = np.full(33, g0, dtype=np.float32)

        def watch(b2: float, g: np.ndarray = g) -> int:
            return bits(_ref().situ_glu(g, u, 4.0, b2))

        lo = float(rng.uniform(2.0, 30.0))
        pair = flip(watch, lo, lo * (1 + 1e-5))
        if pair is not None:
            out += [(f"situ_glu g={float(g0)!r} b2={b2!r}", (g, u, 4.0, b2)) for b2 in pair]
    return out


def _mla_cases(want: int = 6) -> list[Case]:
    """Scores set directly (one-hot query, scale 1): the max at 0, the target ``t`` at a
    score where ``exp_d`` is not the correctly rounded exp, three knobs far below the max
    (``e`` about 1e-5, 1e-11 and 1e-16 of the denominator) bisected coarse to fine, the
    rest at -37 (each ``e`` a little under half an ulp of 1.0, so every order of summing the
    denominator loses a different number of them) and -1000 (``exp_d`` gives exactly 0);
    ``v`` one-hot on the target, so the output is ``p_t`` itself."""
    out: list[Case] = []
    rng = np.random.default_rng(41)
    S, n, r, dv = 200, 24, 8, 3
    KNOBS = (17, 33, 38)
    tried = 0
    while len(out) < 2 * want and tried < 200:
        tried += 1
        st = np.float32(rng.uniform(-3.0, -0.3))
        if float(exp_d(np.float64(st))) == exp_cr(float(st)):
            continue
        q = np.zeros((1, 1, n + r), dtype=np.float32)
        q[0, 0, 0] = 1.0
        v = np.zeros((S, 1, dv), dtype=np.float32)
        v[1, 0, :] = 1.0

        def build(vals: list[float], st: np.float32 = st, v: np.ndarray = v,
                  q: np.ndarray = q) -> tuple[Any, ...]:
            kn = np.zeros((S, 1, n), dtype=np.float32)
            kn[:, 0, 0] = -37.0  # e = 0.77 * 2**-53: lost against 1.0, kept against each other
            kn[-3:, 0, 0] = -1000.0  # exp_d gives exactly 0
            kn[0, 0, 0], kn[1, 0, 0] = 0.0, st
            kn[list(KNOBS), 0, 0] = vals  # spread over the lanes and past 32
            return (q, kn, np.zeros((S, r), dtype=np.float32), v, S - 1, 1.0)

        def watch(vals: list[float], build: Any = build) -> int:
            return bits(_quiet(_ref().mla_attention, *build(vals)))

        found = staged(watch, [(-14.0, -9.0), (-32.0, -22.0), (-48.0, -33.0)])
        if found is not None:
            out += [(f"mla softmax p_t={float(st)!r} {side}", build(vals))
                    for side, vals in zip(("below", "above"), found, strict=True)]
    for name, pat in CANCEL_PATTERNS.items():  # the score's dot product, nope and rope dims
        S2, n2 = 4, 24 if pat[2] < 40 else 40
        r2 = pat[2] + 8 - n2  # the -big term lies in the rope dims
        q = np.zeros((1, 2, n2 + r2), dtype=np.float32)
        q[0, :, pat[0]], q[0, :, pat[1]], q[0, :, pat[2]] = BIG, SMALL, BIG  # the key has the signs
        key = np.zeros(n2 + r2, dtype=np.float32)
        key[[pat[0], pat[1]]], key[pat[2]] = 1.0, -1.0
        kn = np.zeros((S2, 2, n2), dtype=np.float32)
        kr = np.zeros((S2, r2), dtype=np.float32)
        kn[0, :, :], kr[0, :] = key[:n2], key[n2:]
        v = np.zeros((S2, 2, dv), dtype=np.float32)
        v[0, :, :], v[1, :, 0] = 1.0, -1.0
        out.append((f"mla score cancel {name} (lanes run on into the rope dims)",
                    (q, kn, kr, v, S2 - 1, 1.0)))
    for name, pat in CANCEL_PATTERNS.items():  # the p·v mixture, equal scores
        S2 = pat[2] + 1
        q = np.zeros((1, 1, n + r), dtype=np.float32)
        kn = np.zeros((S2, 1, n), dtype=np.float32)
        v = np.zeros((S2, 1, dv), dtype=np.float32)
        for j in range(dv):
            v[:, 0, j] = _cancel_vector(S2, pat, 1.0 if j % 2 else -1.0)
        out.append((f"mla mixture cancel {name}",
                    (q, kn, np.zeros((S2, r), dtype=np.float32), v, S2 - 1, 1.0)))
    return out


def _latent_case(label: str, qv: np.ndarray, keys: np.ndarray, w_v: np.ndarray,
                 n_lat: int, bf16: bool) -> Case:
    """One ``mla_latent_attention`` case from the concatenated query ``qv`` ``[C+r]`` (the
    absorbed part set exactly through ``n = 1``, ``q_nope = 1`` and ``W_k[h][0] = qv[:C]``),
    the cache rows ``keys`` ``[S, C+r]`` and ``W_v[h]`` ``[dv, C]``; two equal heads."""
    C = n_lat
    S, dv = keys.shape[0], w_v.shape[0]
    H = 2
    q = np.zeros((1, H, 1 + qv.shape[0] - C), dtype=np.float32)
    q[0, :, 0] = 1.0
    q[0, :, 1:] = qv[C:]
    w = np.zeros((H * (1 + dv), C), dtype=np.float32)
    for h in range(H):
        w[h * (1 + dv)] = qv[:C]
        w[h * (1 + dv) + 1 : (h + 1) * (1 + dv)] = w_v
    if bf16:  # every value here is exact in bf16
        w = (w.view(np.uint32) >> 16).astype(np.uint16)
    return (f"{label}{' bf16' if bf16 else ''}", (q, keys.copy(), w, S - 1, 1.0))


def _latent_cases() -> list[Case]:
    """Cancelling terms in each of the four reductions of the absorbed MLA: the absorbed
    query (over n), the score (over C + r, lanes running on from the latent into the rope
    dims), the latent mixture (over positions) and the ``W_v`` product (over C)."""
    out: list[Case] = []
    for name, pat in CANCEL_PATTERNS.items():
        for bf16 in (False, True):
            # absorbed query: q_nope carries the pattern, W_k is all ones
            n = pat[2] + 1
            q = np.zeros((1, 2, n + 8), dtype=np.float32)
            q[0, :, :n] = _cancel_vector(n, pat)
            w = np.zeros((2 * (n + 4), 4), dtype=np.float32)
            for h in range(2):
                w[h * (n + 4) : h * (n + 4) + n] = 1.0
                w[h * (n + 4) + n : (h + 1) * (n + 4)] = np.eye(4, dtype=np.float32)
            cache = np.zeros((3, 4 + 8), dtype=np.float32)
            cache[0, :4] = 1.0
            if bf16:
                w = (w.view(np.uint32) >> 16).astype(np.uint16)
            out.append((f"mla_latent_attention query cancel {name}{' bf16' if bf16 else ''}",
                        (q, cache, w, 2, 1.0)))
            # the score: +big and the small term in the latent dims, -big in the rope dims
            C = 24 if pat[2] < 40 else 40
            width = pat[2] + 8
            qv = np.zeros(width, dtype=np.float32)
            qv[[pat[0], pat[1], pat[2]]] = BIG, SMALL, BIG
            keys = np.zeros((4, width), dtype=np.float32)
            keys[0, [pat[0], pat[1]]], keys[0, pat[2]] = 1.0, -1.0
            keys[1, 0] = -1.0  # another row, so that the mixture shows the softmax
            out.append(_latent_case(f"mla_latent_attention score cancel {name}", qv, keys,
                                    np.eye(C, dtype=np.float32)[:3], C, bf16))
            # the mixture over positions, equal scores
            S, C = pat[2] + 1, 4
            keys = np.zeros((S, C + 8), dtype=np.float32)
            for c in range(C):
                keys[:, c] = _cancel_vector(S, pat, 1.0 if c % 2 else -1.0)
            out.append(_latent_case(f"mla_latent_attention mixture cancel {name}",
                                    np.zeros(C + 8, dtype=np.float32), keys,
                                    np.eye(C, dtype=np.float32), C, bf16))
            # the W_v product over the latent width
            C = pat[2] + 1
            keys = np.zeros((3, C + 8), dtype=np.float32)
            keys[:, :C] = 1.0
            w_v = np.stack([_cancel_vector(C, pat), -_cancel_vector(C, pat)])
            out.append(_latent_case(f"mla_latent_attention output cancel {name}",
                                    np.zeros(C + 8, dtype=np.float32), keys, w_v, C, bf16))
    return out


def _router_cases() -> list[Case]:
    """The renormalisation sum: the winner (weight ~0.9), three knobs (weights ~1e-5, ~1e-11,
    ~1e-16) and 52 selected weights of 0.77 * 2**-53 relative to it (each lost against the
    winner, kept against each other, so every other order loses a different number), the rest
    far below; the knobs' logits are bisected until the winner's weight sits on a float32
    rounding boundary."""
    out: list[Case] = []
    N, k = 64, 56
    base = np.full((1, N), np.float32(-80.0), dtype=np.float32)
    base[0, 1:k] = np.float32(-37.0)  # sigmoid(-37) ~ 8.5e-17
    bias = np.zeros(N, dtype=np.float32)
    for w0 in (2.0, 0.5, -0.7):
        row = base.copy()
        row[0, 0] = np.float32(w0)

        def build(vals: list[float], row: np.ndarray = row) -> tuple[Any, ...]:
            x = row.copy()
            x[0, 1:4] = vals
            return (x, bias, k, True, 1.0)

        def watch(vals: list[float], build: Any = build) -> int:
            return bits(_quiet(_ref().router, *build(vals))[1], 0)

        found = staged(watch, [(-14.0, -9.0), (-32.0, -22.0), (-40.0, -33.0)])
        if found is not None:
            out += [(f"router renorm w0={w0} {side}", build(vals))
                    for side, vals in zip(("below", "above"), found, strict=True)]
    return out


#: Float32 inputs where the op written as the contract but with a correctly rounded float64
#: exp (the best a library exp does) rounds to another float32 than the contract's ``exp_d``:
#: the only inputs through which the float32-only ops can show a library ``exp``. Found by
#: evaluating every float32 ``x`` with ``2**-24 <= |x| <= 88.7`` (about 5.2e8 values per op)
#: and checking each whose float64 value lies within 3 ulps of a float32 rounding midpoint
#: against a 60-digit decimal exp; that there are so few is why a library exp is otherwise
#: invisible in these ops.
#: ``exp`` has one; ``sigmoid`` and ``silu`` have none (there a library exp cannot change a
#: float32 result in that range; it shows in the ops that use them: SiTU, the router, KDA).
HARD_FLOAT32: dict[str, tuple[int, ...]] = {
    "exp": (0xC16912CD,),  # -14.567090034484863
}


def _hard_cases(op: str) -> list[Case]:
    x = np.array(HARD_FLOAT32[op], dtype=np.uint32).view(np.float32)
    wide = np.resize(x, 33)  # also inside a vector body, not only a scalar tail
    return [(f"{op} float32 inputs at a rounding boundary", (x.copy(),)),
            (f"{op} float32 inputs at a rounding boundary x33", (wide.copy(),))]


_BUILDERS: dict[str, Callable[[], list[Case]]] = {
    "matmul": _matmul_cases,
    "rmsnorm": lambda: _norm_cases("rmsnorm", (64, 1000, 4097, 7168)),
    "l2norm": lambda: _norm_cases("l2norm", (128, 1000, 4097)),
    "attn_res": _attn_res_cases,
    "kda_recurrent": _kda_recurrent_cases,
    "kda_gate": _kda_gate_cases,
    "situ_glu": _situ_cases,
    "mla_attention": _mla_cases,
    "mla_latent_attention": _latent_cases,
    "router": _router_cases,
}
for _op in HARD_FLOAT32:
    _BUILDERS[_op] = functools.partial(_hard_cases, _op)
#: the ops with adversarial cases (``matmul`` covers matmul_f32, matmul_bf16, matmul_mxfp4)
OPS = tuple(_BUILDERS)


@functools.cache
def cases(op: str) -> tuple[Case, ...]:
    """The adversarial cases of ``op`` (built once per process from the reference)."""
    built = tuple(_BUILDERS[op]())
    if not built:
        raise AssertionError(f"no adversarial case could be built for {op}")
    return built


def op_of(label: str) -> str:
    """The backend method a case calls (its label starts with it)."""
    head = label.split()[0]
    return "mla_attention" if head == "mla" else head
