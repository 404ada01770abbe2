"""The kernel interface and the bit-exact contract every backend follows.

The model graph (``k3core.model.forward``) is written once against :class:`KernelBackend`. A backend
is correct only if every method returns arrays whose **bytes** equal the NumPy reference
backend's for the same inputs, at every thread count. The arithmetic is therefore defined
here, not left to the backend (``docs/kernel-contract.md`` is the long form of this text):

Notation
    ``f32(v)`` rounds a float64 value to float32 (IEEE round-to-nearest-even; overflow gives
    +-inf). Arrays are C-contiguous; activations are float32. ``d(v)`` widens float32 to
    float64 (exact). The IEEE default environment is assumed: round to nearest even,
    subnormals honoured (no flush-to-zero / denormals-are-zero).

Special values
    +-0, subnormals, +-inf follow IEEE through the operations as written (a lane sum is never
    -0.0: lanes start at +0.0). A NaN input gives NaN wherever IEEE propagation does; the
    sign and payload of a NaN output are not part of the contract (conformance compares NaN
    as a class), everything else is compared bit for bit.

Elementwise float32 ops
    Every float32 ``+``, ``-``, ``*`` is rounded on its own. No fused multiply-add anywhere
    (C: ``-ffp-contract=off``, no fast-math; Numba: ``fastmath=False``).

Lane sum ``lsum(terms)``
    The one long-reduction order. Terms are float64 (products of float32 with bf16, float32
    or MXFP4 values are exact in float64). Term ``i`` goes to lane ``i % LANES``
    (``k3core.api.contract.LANES`` = 32); each lane starts at +0.0 and adds its terms in
    increasing ``i``; the lanes are then folded in halves (lane ``j`` += lane ``j+h`` for
    ``h`` = 16, 8, 4, 2, 1); the result is lane 0. ``dot(a, b) = lsum(d(a[i]) * d(b[i]))``.

Transcendentals (float64, defined by ``k3core.api.contract`` constants)
    ``exp_d(x)``: ``+inf`` above ``EXP_HI``, ``+0.0`` below ``EXP_LO``, NaN for NaN; else
    ``n = floor(x*LOG2E + 0.5)``, ``r = (x - n*LN2_HI) - n*LN2_LO``,
    ``p = Horner(EXP_COEF, r)`` from the top (``p = c13; p = p*r + c12; ...``),
    ``ldexp(p, n)``.
    ``expm1_d(x)``: for ``|x| < EXPM1_SERIES_MAX``: ``q = Horner(EXPM1_COEF, x)`` from the
    top, result ``q*x``; else ``exp_d(x) - 1``.
    ``tanh_d(x)``: ``a = |x|``; ``t = 1`` if ``a > TANH_SAT`` else
    ``e = expm1_d(2a); t = e / (e + 2)``; ``copysign(t, x)``.
    ``sig_d(x) = 1 / (1 + exp_d(-x))``.

Ops (each row below is what the reference computes; shapes use T = tokens)
    ``matmul(W[out,in], x[T,in]) -> [T,out]``: ``y[t,o] = f32(dot(W[o,:], x[t,:]))`` for
    W bf16 (uint16 bit patterns), float32, or MXFP4 (packed nibbles + E8M0 scales, value
    ``E2M1[nibble] * E8M0[scale]``, low nibble = even column, scale byte 255 = 0.0).
    ``rmsnorm(x[T,m], w[m] | None, eps)``: ``inv = f32(1 / sqrt(lsum(d(x)^2) / m + eps))``;
    ``y = x * inv`` (float32) then ``* w`` (float32) when a gain is given.
    ``l2norm(x[..., D])``: ``inv = f32(1 / sqrt(lsum(d(x)^2) + L2_EPS))``; ``y = x * inv``.
    ``sigmoid(x) = f32(sig_d(x))``; ``silu(x) = f32(d(x) * sig_d(x))``;
    ``exp(x) = f32(exp_d(x))``.
    ``situ_glu(g, u, b1, b2) = f32((b1 * tanh_d(g/b1) * sig_d(g)) * (b2 * tanh_d(u/b2)))``
    with every operation in float64, left to right as written.
    ``shortconv(x[T,C], w[C,K], hist[C,K-1])``: per channel, float32:
    ``acc = w[K-1]*x_t; acc = acc + w[j]*hist[j]`` for j = 0..K-2; then shift ``hist`` left
    and append ``x_t``; output ``silu(acc)``. ``hist`` is updated in place.
    ``kda_gate(z[T,P], dt[P], A_log[H], lb) -> alpha``: per head h and channel:
    ``alpha = f32(exp_d(lb * sig_d(exp_d(A_log[h]) * (d(z) + d(dt)))))``.
    ``kda_recurrent(q, k, v, alpha: [T,H,D], beta[T,H], S[H,D,D])``: per token, per head,
    float32 unless stated: ``S[i,:] = alpha[i] * S[i,:]``;
    ``u[j] = f32(lsum_i(d(k[i]) * d(S[i,j])))``; ``w[j] = beta * (v[j] - u[j])``;
    ``S[i,j] = S[i,j] + k[i] * w[j]``; ``o[j] = f32(lsum_i(d(q[i]) * d(S[i,j])))``.
    ``S`` is updated in place; heads are independent.
    ``softmax`` (inside attention ops): ``m = max(s)`` (NaN if any ``s_i`` is NaN);
    ``e_i = exp_d(d(s_i) - d(m))``; ``Z = lsum(e)`` (kept in float64); ``p_i = f32(e_i / Z)``.
    ``mla_attention(q[T,H,n+r], k_nope[S,H,n], k_rope[S,r], v[S,H,dv], pos0, scale)``:
    query t sits at absolute position ``pos0 + t`` and attends to ``s <= pos0 + t``;
    ``score[s] = f32(dot([q_nope|q_rope], [k_nope[s]|k_rope[s]]) * scale)`` over the
    concatenated ``n + r`` dims (nope first), ``scale`` a float64;
    ``p = softmax(score)``; ``o[j] = f32(lsum_s(d(p[s]) * d(v[s,j])))``.
    ``mla_latent_attention(q[T,H,n+r], cache[S,C+r], w_kvb[H*(n+dv),C], pos0, scale)``:
    absorbed MLA over the latent cache (row ``s`` = normed latent ``[C]`` then ``k_rope``
    ``[r]``; ``C`` = ``w_kvb`` columns, ``r`` = cache width - C, ``n`` = q width - r,
    ``dv`` = rows/H - n; ``w_kvb`` bf16 or float32). Head h's rows ``h*(n+dv) ..+n`` are
    ``W_k[h]`` ``[n,C]``, the next ``dv`` rows ``W_v[h]``. Per query t (position
    ``pos0 + t``, keys ``s <= pos0 + t``) and head h:
    ``q_lat[c] = f32(lsum_i(d(q[t,h,i]) * d(W_k[h][i,c])))`` (i = 0..n-1, lane ``i % 32``);
    ``score[s] = f32(dot([q_lat|q_rope], cache[s]) * scale)`` (lanes continue over the
    ``C + r`` dims); ``p = softmax(score)``;
    ``o_lat[c] = f32(lsum_s(d(p[s]) * d(cache[s,c])))``;
    ``o[t,h,j] = f32(dot(W_v[h][j,:], o_lat))``. Equivalently, per head,
    ``matmul(W_k[h]^T, q_nope)``, then ``mla_attention`` with one shared key/value head
    (``k_nope = v = latent``), then ``matmul(W_v[h], o_lat)``: the default implementation.
    ``attn_res(src[S,T,E], fold[E], eps)``: per token, ``key_s = rmsnorm(src_s, None, eps)``;
    ``score_s = f32(dot(key_s, fold))``; ``p = softmax(score)``;
    ``out[i] = f32(lsum_s(d(p[s]) * d(src[s,i])))`` (raw sources are mixed).
    ``router(logits[T,N], bias[N], k, renorm, scale)``: ``s = sigmoid(logits)``;
    ``c = s + bias`` (float32); pick ``min(k, N)`` by repeated maximum of ``c`` with ties
    to the lowest index (+0.0 ties -0.0) and NaN below every number, listed in selection
    order; ``w_j = s[idx_j]``; when ``k > 1`` and ``renorm``:
    ``w_j = f32(d(w_j) / (lsum(d(w)) + ROUTER_EPS))``; finally ``w_j = w_j * f32(scale)``.

Parallelism is allowed only over independent outputs (rows, tokens, heads, experts); a
reduction is never split across threads, so the bits do not depend on the thread count.
Conformance is proved with :class:`k3core.testing.kernel_conformance.KernelConformance`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]
U8 = NDArray[np.uint8]
U16 = NDArray[np.uint16]

#: Environment variable that makes backends created without an explicit choice take every
#: parallel path (``KernelBackend.set_force_parallel``): ``1`` on, ``0`` or unset off.
FORCE_PARALLEL_ENV = "K3_FORCE_PARALLEL"


def force_parallel_from_env() -> bool:
    """``K3_FORCE_PARALLEL``: ``1``/``true``/``yes`` on, ``0``/``false``/``no``/unset off."""
    raw = os.environ.get(FORCE_PARALLEL_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    from k3core.api.errors import PluginError

    raise PluginError(
        f"{FORCE_PARALLEL_ENV}={raw!r} is not a switch",
        hint=f"set {FORCE_PARALLEL_ENV} to 1 or 0, or unset it",
    )


@dataclass(frozen=True)
class Mxfp4:
    """An MXFP4 matrix straight from the checkpoint: logical shape ``[rows, cols]``.

    ``packed`` is ``uint8[rows, cols/2]`` (low nibble = even column), ``scales`` is
    ``uint8[rows, cols/32]`` (E8M0 bytes).
    """

    packed: U8
    scales: U8

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.packed.shape[0]), int(self.packed.shape[1]) * 2)


W = U16 | F32 | Mxfp4


@dataclass(frozen=True)
class KdaWeights:
    """One KDA layer's weights, as :meth:`KernelBackend.kda_mix` takes them (``docs/model.md``
    §5.4): ``proj`` the six projections of the layer's input (q, k, v, the beta logits, the
    gate's down-projection, the output gate), ``f_b`` the gate's up-projection, ``conv`` the
    q/k/v short-convolution kernels ``[H*D, K]``, ``o_norm`` the per-head output norm's gain
    ``[D]``, ``o_proj`` the output projection; ``lower_bound`` the gate bound, ``q_scale``
    the float32 query scale, ``eps`` the norm's epsilon."""

    proj: tuple[W, W, W, W, W, W]
    f_b: W
    dt_bias: F32
    a_log: F32
    conv: tuple[F32, F32, F32]
    o_norm: F32
    o_proj: W
    lower_bound: float
    q_scale: float
    eps: float


@dataclass(frozen=True)
class KdaSeq:
    """One sequence's share of a :meth:`KernelBackend.kda_mix` call: its ``rows`` of the
    input (the sequences' rows follow one another) and its state, updated in place: the
    q/k/v short-convolution histories ``[H*D, K-1]`` and the recurrent state ``[H, D, D]``."""

    rows: int
    hist: tuple[F32, F32, F32]
    state: F32


@dataclass(frozen=True)
class MlaWeights:
    """One gated MLA layer's weights, as :meth:`KernelBackend.mla_mix` takes them
    (``docs/model.md`` §5.5): ``q_a`` and ``kv_a`` the down-projections of the layer's input
    (``kv_a`` gives the latent's ``kv_lora`` columns, then the rope key), ``gate`` the output
    gate (None for an ungated model), their norms' gains, ``q_b`` the query up-projection,
    ``kv_b`` the key/value up-projection the attention absorbs, ``o_proj``; ``heads`` the
    attention heads, ``scale`` the scores' float64 scale, ``eps`` the norms' epsilon."""

    q_a: W
    kv_a: W
    gate: W | None
    q_a_norm: F32
    kv_a_norm: F32
    q_b: W
    kv_b: U16 | F32
    o_proj: W
    kv_lora: int
    heads: int
    scale: float
    eps: float


@dataclass(frozen=True)
class MlaSeq:
    """One sequence's share of a :meth:`KernelBackend.mla_mix` call: its ``rows`` of the
    input, its KV ``cache`` ``[capacity, kv_lora + rope]`` (rows ``pos .. pos + rows`` are
    written in place), the positions ``pos`` before them, and how many of its last rows
    ``attend`` (all of them, or a pass's last layer's asked rows)."""

    rows: int
    cache: F32
    pos: int
    attend: int


class KernelBackend(ABC):
    """Interface every kernel backend implements; see the module docstring for the contract.

    Inputs are never modified except the documented in-place state (``shortconv``'s
    ``hist``, ``kda_recurrent``'s ``S``). Outputs are freshly allocated float32 arrays.
    """

    name: str = "?"

    def set_threads(self, n: int) -> None:  # noqa: B027 - optional for single-threaded backends
        """Use up to ``n`` threads (``n >= 1``) for parallel work over independent outputs."""

    @property
    def threads(self) -> int:
        return 1

    def set_force_parallel(self, on: bool) -> None:  # noqa: B027 - optional
        """Take every parallel code path whenever more than one thread is set, however small
        the work (off by default; ``K3_FORCE_PARALLEL=1`` switches it on at creation).

        A backend normally keeps small kernels on one thread (waking a worker costs more
        than they take); the conformance suite switches this on so that the multi-threaded
        code runs on the small test models too. Results never depend on it. A backend
        without thresholds may ignore it.
        """

    @property
    def parallel_forced(self) -> bool:
        return False

    # --- matrix products ------------------------------------------------------------------
    @abstractmethod
    def matmul_bf16(self, w: U16, x: F32) -> F32: ...

    @abstractmethod
    def matmul_f32(self, w: F32, x: F32) -> F32: ...

    @abstractmethod
    def matmul_mxfp4(self, w: Mxfp4, x: F32) -> F32: ...

    # --- normalisation and activations ------------------------------------------------
    @abstractmethod
    def rmsnorm(self, x: F32, w: F32 | None, eps: float) -> F32: ...

    @abstractmethod
    def l2norm(self, x: F32) -> F32: ...

    @abstractmethod
    def sigmoid(self, x: F32) -> F32: ...

    @abstractmethod
    def silu(self, x: F32) -> F32: ...

    @abstractmethod
    def exp(self, x: F32) -> F32: ...

    @abstractmethod
    def situ_glu(self, g: F32, u: F32, b1: float, b2: float) -> F32: ...

    # --- attention building blocks --------------------------------------------------------
    @abstractmethod
    def shortconv(self, x: F32, w: F32, hist: F32) -> F32: ...

    @abstractmethod
    def kda_gate(self, z: F32, dt_bias: F32, a_log: F32, lower_bound: float) -> F32: ...

    @abstractmethod
    def kda_recurrent(self, q: F32, k: F32, v: F32, alpha: F32, beta: F32, state: F32) -> F32: ...

    @abstractmethod
    def mla_attention(
        self, q: F32, k_nope: F32, k_rope: F32, v: F32, pos0: int, scale: float
    ) -> F32: ...

    def mla_latent_attention(
        self, q: F32, cache: F32, w_kvb: U16 | F32, pos0: int, scale: float
    ) -> F32:
        """Absorbed MLA attention over the latent KV cache (the contract's row above).

        Not abstract, so backends written before it keep working: this default composes it
        from :meth:`matmul` and :meth:`mla_attention` head by head, with exactly the
        contract's bits. A backend should override it with one fused call.
        """
        T, H, n, C, r, dv = latent_shapes(q, cache, w_kvb, pos0)
        lat = cache[: pos0 + T]
        k_lat = np.ascontiguousarray(lat[:, None, :C])
        k_rope = np.ascontiguousarray(lat[:, C:])
        out = np.empty((T, H, dv), dtype=np.float32)
        for h in range(H):
            rows = w_kvb[h * (n + dv) : (h + 1) * (n + dv)]
            w_kt = cast(U16 | F32, np.ascontiguousarray(rows[:n].T))
            q_lat = self.matmul(w_kt, np.ascontiguousarray(q[:, h, :n]))
            qq = np.concatenate([q_lat, q[:, h, n:]], axis=-1)[:, None, :]
            o_lat = self.mla_attention(qq, k_lat, k_rope, k_lat, pos0, scale)[:, 0, :]
            w_v = cast(U16 | F32, np.ascontiguousarray(rows[n:]))
            out[:, h, :] = self.matmul(w_v, np.ascontiguousarray(o_lat))
        return out

    @abstractmethod
    def attn_res(self, sources: F32, fold: F32, eps: float) -> F32: ...

    @abstractmethod
    def router(
        self, logits: F32, bias: F32, k: int, renorm: bool, scale: float
    ) -> tuple[NDArray[np.int64], F32]: ...

    # --- fused products: defaults are the separate ops (a backend may do them in one call) ----
    def matmul_many(self, ws: Sequence[U16 | F32 | Mxfp4], x: F32) -> list[F32]:
        """``[matmul(w, x) for w in ws]``: several matrices over the same input (q/k/v...).

        A backend may widen ``x`` once and run every row of every matrix in one parallel
        region; each output is the same lane sum, so the bits are the separate calls'.
        """
        return [self.matmul(w, x) for w in ws]

    def situ_mlp(
        self, w1: U16 | F32 | Mxfp4, w3: U16 | F32 | Mxfp4, w2: U16 | F32 | Mxfp4, x: F32,
        b1: float, b2: float,
    ) -> F32:
        """``matmul(w2, situ_glu(matmul(w1, x), matmul(w3, x), b1, b2))``: a SiTU MLP (an
        expert, the shared experts, the dense MLP) in one call, with exactly those bits."""
        return self.matmul(w2, self.situ_glu(self.matmul(w1, x), self.matmul(w3, x), b1, b2))

    def situ_mlp_many(
        self, mlps: Sequence[tuple[U16 | F32 | Mxfp4, U16 | F32 | Mxfp4, U16 | F32 | Mxfp4]],
        xs: Sequence[F32], b1: float, b2: float,
    ) -> list[F32]:
        """``[situ_mlp(w1, w3, w2, x, b1, b2) for (w1, w3, w2), x in zip(mlps, xs)]``: the
        routed experts of one MoE layer, each over its own token rows, with exactly those bits.

        A backend may run them all in one call (one parallel region per stage over every
        expert's rows); each output is still the same lane sum, so the bits cannot change.
        """
        if len(mlps) != len(xs):
            raise ValueError(f"situ_mlp_many: {len(mlps)} MLPs but {len(xs)} inputs")
        return [self.situ_mlp(w1, w3, w2, x, b1, b2) for (w1, w3, w2), x in zip(mlps, xs, strict=True)]

    # --- fused layer parts: defaults are the separate ops (a backend may do them in one call) --
    def attn_res_norm(self, sources: F32, fold: F32, w: F32, eps: float) -> F32:
        """``rmsnorm(attn_res(sources, fold, eps), w, eps)``: a layer part's input (the block
        attention residual, then the part's norm) in one call, with exactly those bits."""
        return self.rmsnorm(self.attn_res(sources, fold, eps), w, eps)

    def kda_mix(self, x: F32, w: KdaWeights, seqs: Sequence[KdaSeq]) -> F32:
        """A KDA layer's token mixer over ``x[T, E]`` (``docs/model.md`` §5.4): the six
        projections, the gate, each sequence's short convolutions and recurrence on its own
        state (``seqs`` split the rows in order and are updated in place), the per-head
        output norm, the output gate and the output projection, with exactly the bits of
        these separate ops, which this default runs (:func:`kda_mix_ops`). ``[T, E]`` out."""
        return kda_mix_ops(self, x, w, seqs)

    def mla_mix(self, x: F32, w: MlaWeights, seqs: Sequence[MlaSeq]) -> F32:
        """A gated MLA layer's attention over ``x[T, E]`` (``docs/model.md`` §5.5): every row's
        latent (``rmsnorm`` of ``kv_a``'s first ``kv_lora`` columns) and rope key written to
        its sequence's cache; the rows that attend (each sequence's last ``attend``) take
        ``q_a``, its norm, ``q_b``, ``mla_latent_attention`` over their own cache, the
        output gate and ``o_proj``; the down-projections of a pass where every row attends
        in one ``matmul_many``. Exactly the bits of these separate ops, which this default
        runs. ``[sum(attend), E]`` out."""
        T = x.shape[0]
        if not seqs or sum(s.rows for s in seqs) != T:
            raise ValueError(f"mla_mix: the sequences' rows do not add up to the {T} input rows")
        if any(not 0 <= s.attend <= s.rows for s in seqs):
            raise ValueError("mla_mix: a sequence attends with more rows than it has")
        C, H = w.kv_lora, w.heads
        part = any(s.attend < s.rows for s in seqs)
        ws = [w.q_a, w.kv_a] + ([w.gate] if w.gate is not None else [])
        if not part:
            qa, ckv, *gate = self.matmul_many(ws, x)
        else:
            ckv = self.matmul(w.kv_a, x)
        latent = self.rmsnorm(np.ascontiguousarray(ckv[:, :C]), w.kv_a_norm, w.eps)
        ends = np.cumsum([s.rows for s in seqs])
        for s, b in zip(seqs, ends, strict=True):
            a = b - s.rows
            s.cache[s.pos : s.pos + s.rows, :C] = latent[a:b]
            s.cache[s.pos : s.pos + s.rows, C:] = ckv[a:b, C:]
        if part:
            keep = np.concatenate([np.arange(b - s.attend, b, dtype=np.int64)
                                   for s, b in zip(seqs, ends, strict=True)])
            if not keep.size:
                return np.empty((0, w.o_proj.shape[0]), dtype=np.float32)
            qa, *gate = self.matmul_many([ws[0], *ws[2:]], np.ascontiguousarray(x[keep]))
        cq = self.rmsnorm(qa, w.q_a_norm, w.eps)
        Q = cq.shape[0]
        q = self.matmul(w.q_b, cq).reshape(Q, H, -1)
        outs, j = [], 0
        for s in seqs:
            if s.attend:  # its last rows attend, from position pos + rows - attend
                outs.append(self.mla_latent_attention(
                    np.ascontiguousarray(q[j : j + s.attend]), s.cache[: s.pos + s.rows], w.kv_b,
                    s.pos + s.rows - s.attend, w.scale))
                j += s.attend
        o = (outs[0] if len(outs) == 1 else np.concatenate(outs)).reshape(Q, -1)
        if w.gate is not None:
            o = o * self.sigmoid(gate[0])
        return self.matmul(w.o_proj, o)

    def moe_route(self, sources: F32, fold: F32, norm: F32, eps: float, gate: W, down: W,
                  bias: F32, k: int, renorm: bool, scale: float,
                  ) -> tuple[F32, NDArray[np.int64], F32, F32]:
        """A LatentMoE block's way in (``docs/model.md`` §5.7): its input
        ``xn = attn_res_norm(sources, fold, norm, eps)``, the router's logits and the
        latent down-projection ``z`` of ``xn`` (``matmul_many([gate, down], xn)``), the
        router's choice ``idx, w = router(logits, bias, k, renorm, scale)``; returns
        ``(xn, idx, w, z)`` with exactly those ops' bits."""
        xn = self.attn_res_norm(sources, fold, norm, eps)
        logits, z = self.matmul_many([gate, down], xn)
        idx, w = self.router(logits, bias, k, renorm, scale)
        return xn, idx, w, z

    def moe_combine(self, w: F32, outs: F32, norm: F32 | None, eps: float, up: W,
                    shared: F32 | None) -> F32:
        """A LatentMoE block's output from its routed experts' latent outputs
        ``outs[T, k, latent]`` and router weights ``w[T, k]`` (``docs/model.md`` §5.7): the
        weighted sum slot by slot from +0.0 (each float32 product rounded, then added),
        the latent norm (``norm``, when the model has one), the up-projection ``up``, plus
        the shared experts' output ``shared`` (float32), with exactly these bits."""
        T, k, lat = outs.shape
        acc = np.zeros((T, lat), dtype=np.float32)
        term = np.empty_like(acc)
        for j in range(k):
            np.multiply(w[:, j : j + 1], outs[:, j], out=term)
            acc += term
        if norm is not None:
            acc = self.rmsnorm(acc, norm, eps)
        y = self.matmul(up, acc)
        return y if shared is None else y + shared

    # --- dispatch helper ----------------------------------------------------------------------
    def matmul(self, w: U16 | F32 | Mxfp4, x: F32) -> F32:
        """Dispatch on the weight's storage type (bf16 bits, float32 or MXFP4)."""
        if isinstance(w, Mxfp4):
            return self.matmul_mxfp4(w, x)
        if w.dtype == np.uint16:
            return self.matmul_bf16(cast(U16, w), x)
        if w.dtype == np.float32:
            return self.matmul_f32(cast(F32, w), x)
        raise TypeError(f"unsupported weight dtype {w.dtype}")


#: a sequence's recurrence in :func:`kda_mix_ops`: ``(sequence index, its raw q/k/v
#: projections, q, k, v, alpha, beta) -> its output rows``
KdaRecurrence = Callable[[int, tuple[F32, F32, F32], F32, F32, F32, F32, F32], F32]


def kda_mix_ops(kb: KernelBackend, x: F32, w: KdaWeights, seqs: Sequence[KdaSeq],
                recur: KdaRecurrence | None = None) -> F32:
    """:meth:`KernelBackend.kda_mix` as its separate ops on ``kb`` (its default). ``recur``
    takes the place of each sequence's ``kda_recurrent`` on its own state (a speculative
    verify pass records its rollback trail there, ``k3core/model/rollback.py``)."""
    T = x.shape[0]
    if sum(s.rows for s in seqs) != T or not seqs:
        raise ValueError(f"kda_mix: the sequences' rows do not add up to the {T} input rows")
    H, D = int(seqs[0].state.shape[0]), int(seqs[0].state.shape[1])
    rq, rk, rv, rb, fa, rg = kb.matmul_many(list(w.proj), x)
    beta = kb.sigmoid(rb)
    alpha = kb.kda_gate(kb.matmul(w.f_b, fa), w.dt_bias, w.a_log, w.lower_bound)
    alpha = alpha.reshape(T, H, D)
    cuts = np.cumsum([0] + [s.rows for s in seqs])
    spans = list(zip(seqs, cuts[:-1], cuts[1:], strict=True))
    convs: list[list[F32]] = [[], [], []]
    for s, a, b in spans:
        for j, r in enumerate((rq, rk, rv)):
            convs[j].append(kb.shortconv(r[a:b], w.conv[j], s.hist[j]))
    qc, kc, vc = (c[0] if len(c) == 1 else np.concatenate(c) for c in convs)
    q = kb.l2norm(qc.reshape(T, H, D)) * np.float32(w.q_scale)
    kk = kb.l2norm(kc.reshape(T, H, D))
    v = vc.reshape(T, H, D)
    outs = [kb.kda_recurrent(q[a:b], kk[a:b], v[a:b], alpha[a:b], beta[a:b], s.state)
            if recur is None else
            recur(i, (rq[a:b], rk[a:b], rv[a:b]), q[a:b], kk[a:b], v[a:b], alpha[a:b], beta[a:b])
            for i, (s, a, b) in enumerate(spans)]
    o = outs[0] if len(outs) == 1 else np.concatenate(outs)
    o = kb.rmsnorm(o, w.o_norm, w.eps).reshape(T, H * D)
    return kb.matmul(w.o_proj, o * kb.sigmoid(rg))


def latent_shapes(
    q: F32, cache: F32, w_kvb: U16 | F32, pos0: int
) -> tuple[int, int, int, int, int, int]:
    """``(T, H, n, C, r, dv)`` of a :meth:`KernelBackend.mla_latent_attention` call, checked.

    Raises ``TypeError`` for a weight that is not bf16 bits or float32 and ``ValueError``
    for shapes that do not agree or too few cached rows.
    """
    if not isinstance(w_kvb, np.ndarray) or w_kvb.dtype not in (np.uint16, np.float32):
        got = w_kvb.dtype if isinstance(w_kvb, np.ndarray) else type(w_kvb).__name__
        raise TypeError(f"mla_latent_attention: w_kvb must be bf16 bits or float32, got {got}")
    if q.ndim != 3 or cache.ndim != 2 or w_kvb.ndim != 2:
        raise ValueError("mla_latent_attention: expected q[T,H,n+r], cache[S,C+r], w_kvb[H*(n+dv),C]")
    T, H, nr = (int(x) for x in q.shape)
    C = int(w_kvb.shape[1])
    r = int(cache.shape[1]) - C
    n = nr - r
    if H < 1 or C < 1 or r < 0 or n < 1 or w_kvb.shape[0] % H or w_kvb.shape[0] // H <= n:
        raise ValueError(f"mla_latent_attention: shapes do not agree: q {q.shape} cache "
                         f"{cache.shape} w_kvb {w_kvb.shape}")
    if pos0 < 0 or pos0 + T > cache.shape[0]:
        raise ValueError(f"mla_latent_attention: queries at {pos0}..{pos0 + T - 1} need "
                         f"{pos0 + T} cached positions, have {cache.shape[0]}")
    return T, H, n, C, r, int(w_kvb.shape[0]) // H - n
