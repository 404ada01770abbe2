"""The Kimi K3 forward pass, written once against the kernel interface (docs/model.md §5).

The graph never asks which kernel backend, storage backend or cache policy it runs on. All
long reductions and transcendentals go through :class:`k3core.api.kernels.KernelBackend`;
the float32 adds and multiplies here are NumPy elementwise ops, which IEEE rounds
identically everywhere, so the logits are a function of the weights and the ids alone.
Where the routed experts are computed (here, or on a cluster's workers) and how their reads
are scheduled is an :class:`~k3core.api.experts.ExpertExecutor`'s business: the MoE step
calls its ``run`` once a layer (``k3core/model/local_experts.py`` is the one a model has).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.api.experts import ExpertExecutor, ExpertSource
from k3core.api.kernels import F32, U16, KernelBackend, Mxfp4
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams
from k3core.model.local_experts import LocalExperts
from k3core.model.residuals import BlockStack
from k3core.model.sources import ModelTables, TrunkSource
from k3core.model.state import SequenceState

LayerHook = Callable[[int, np.ndarray], None]

#: what ``--lookahead on`` means: the approximation that measured best (docs/expert-cache.md)
LOOKAHEAD_ON = "out"
LOOKAHEAD_MODES = ("off", "attn", "out")


def lookahead_mode(value: str) -> str:
    """``on`` -> :data:`LOOKAHEAD_ON`; ``off``, ``attn``, ``out`` as given; else refused."""
    mode = LOOKAHEAD_ON if value == "on" else value
    if mode not in LOOKAHEAD_MODES:
        raise UsageError(f"--lookahead must be on, off, attn or out, got {value!r}")
    return mode


class Model:
    """One model: config, kernels, and where its trunk, tables and experts come from."""

    def __init__(
        self,
        cfg: ModelConfig,
        kernels: KernelBackend,
        trunk: TrunkSource,
        tables: ModelTables,
        experts: ExpertSource,
        n_layers: int | None = None,
    ):
        self.cfg = cfg
        self.k = kernels
        self.trunk = trunk
        self.tables = tables
        self.n_layers = n_layers or cfg.n_layers
        self.mla_scale = 1.0 / math.sqrt(cfg.qk_nope + cfg.qk_rope)
        self.q_scale = np.float32(1.0 / math.sqrt(cfg.kda_head_dim))
        self.layers_completed = 0
        self.on_layer: LayerHook | None = None
        #: full recompute reuses one KDA state slot across layers (ultra-low-memory)
        self.shared_kda_slot = False
        #: who computes the routed experts: here, from ``experts`` (the model's own, closed
        #: by :meth:`close`), or an executor handed over by :meth:`hand_experts`
        self._local = LocalExperts(experts, kernels, cfg.situ_b1, cfg.situ_b2)
        self.executor: ExpertExecutor = self._local
        #: router lookahead (docs/expert-cache.md): "off", "attn" (guess layer L+1's experts
        #: from layer L's MLP input) or "out" (from layer L's output); never changes the bits
        self.lookahead = "off"
        #: guesses not made because layer L+1's trunk was not resident or read yet
        self.lookahead_unready = 0
        #: feed more ids than this in chunks of at most this many (None: one pass); the
        #: logits are the unchunked ones bit for bit, the activations are one chunk's
        self.prefill_chunk: int | None = None
        #: the number of passes the last forward took (1 unless it was chunked)
        self.chunks_last = 0

    # ---- top level ------------------------------------------------------------------------
    def forward(self, ids: np.ndarray, state: SequenceState, all_logits: bool = False,
                tail: int = 1) -> np.ndarray:
        """Consume ``ids`` after ``state.pos`` positions; logits of the last ``tail`` (or
        every) position(s). Each row's logits are the bytes a one-row pass would give."""
        ids = np.asarray(ids, dtype=np.int64)
        T = ids.shape[0]
        state.check_room(T)
        self.executor.begin_step()
        want = T if all_logits else max(1, min(tail, T))  # trailing rows whose logits are asked
        n = self.prefill_chunk
        if n is None or n < 1 or T <= n:
            self.chunks_last = 1
            return self._pass(ids, state, want)
        # a long prompt in chunks: each chunk carries the state (KDA, conv history, KV cache)
        # to the next exactly as one pass would, and every op is per token or causal, so the
        # logits are the one-pass logits; each routed expert is read once per chunk
        starts = range(0, T, n)
        self.chunks_last = len(starts)
        outs = []
        for a in starts:
            m = min(n, T - a)
            outs.append(self._pass(ids[a : a + m], state, max(0, min(m, a + m - (T - want)))))
        return np.concatenate([o for o in outs if o.shape[0]])

    def _pass(self, ids: np.ndarray, state: SequenceState, rows: int) -> np.ndarray:
        """One pass over every layer for ``ids``; the logits of its last ``rows`` rows."""
        T = ids.shape[0]
        self.layers_completed = 0
        h = self.tables.embed(ids)
        c = self.cfg
        blocks = BlockStack(T, c.hidden, len(range(0, self.n_layers, c.attn_res_block)) + 1)
        for L in range(self.n_layers):
            p = self.trunk.acquire(L)
            # the last layer's MLP only for the rows whose logits are asked (unless a hook
            # watches every row of every layer): no later layer reads its other rows
            keep = rows if L == self.n_layers - 1 and self.on_layer is None else None
            try:
                h = self.layer(p, h, blocks, state, keep)
            finally:
                self.trunk.release(L)
            self.layers_completed = L + 1
            if self.on_layer is not None:
                self.on_layer(L, h)
        if rows <= 0:
            state.pos += T
            return np.empty((0, self.cfg.vocab), dtype=np.float32)
        h = self.k.attn_res(blocks.sources(h), self.tables.fold_out, self.cfg.rms_eps)
        last = h[h.shape[0] - rows :]
        x = self.k.rmsnorm(last, self.tables.norm, self.cfg.rms_eps)
        out = self.tables.logits(self.k, x)
        state.pos += T
        if not np.all(np.isfinite(out)):
            raise K3Error("the forward pass produced non-finite logits; refusing to pick a token")
        return out

    # ---- one decoder layer with block attention residuals (docs/model.md §5.2) ------------------
    def layer(self, p: LayerParams, h: np.ndarray, blocks: BlockStack, st: SequenceState,
              keep: int | None = None) -> np.ndarray:
        """One layer over every row of ``h``; with ``keep``, its attention still over every row
        (the KV cache and the KDA state take them all) and the rest only over the last ``keep``
        rows, ``blocks`` cut to the same rows: every op after the attention is per row, so
        those rows' bits are the full layer's. The output then has ``keep`` rows."""
        eps = self.cfg.rms_eps
        pref: np.ndarray | None = h
        x_a = self.k.attn_res(blocks.sources(h), p["fold_attn"], eps) if len(blocks) else h
        if p.layer % self.cfg.attn_res_block == 0:
            blocks.append(h)
            pref = None
        xn = self.k.rmsnorm(x_a, p["input_layernorm.weight"], eps)
        T = xn.shape[0]
        a = self.mla(p, xn, st, keep) if p.mla else self.kda(p, xn, st)
        self.trunk.begin_mlp(p.layer)  # a split layer's MLP part replaces its attention part
        if keep is not None and keep < T:
            a = a[a.shape[0] - keep :]  # (an MLA layer's output has only those rows already)
            pref = None if pref is None else pref[pref.shape[0] - keep :]
            blocks.keep_last(keep)
            if keep == 0:  # no row asked (a chunk before the last): nothing reads the output
                return a
        pref = a if pref is None else pref + a
        x_m = self.k.attn_res(blocks.sources(pref), p["fold_mlp"], eps)
        early = self.guess(p.layer + 1, x_m) if self.lookahead == "attn" else None
        xn = self.k.rmsnorm(x_m, p["post_attention_layernorm.weight"], eps)
        if p.dense:
            m = self.dense_mlp(p, xn)
            if early is not None:
                self.executor.lookahead(*early)
        else:
            m = self.moe(p, xn, early)  # handed on behind the layer's own reads
        out = pref + m
        if self.lookahead == "out":
            late = self.guess(p.layer + 1, out, blocks)
            if late is not None:
                self.executor.lookahead(*late)
        return out

    # ---- router lookahead (docs/expert-cache.md, "Router lookahead") ----------------------------
    def guess(self, layer: int, x: np.ndarray,
              blocks: BlockStack | None = None) -> tuple[int, list[int]] | None:
        """Layer ``layer``'s router applied to ``x``, an approximation of its MLP input: its
        top-k ids, or ``None`` (a dense or missing layer, its trunk not resident/read yet, or
        an executor that takes no guesses).
        With ``blocks`` the approximation first takes ``layer``'s MLP attention residual of
        ``blocks + [x]``. Only reads are started from a guess; the real router decides."""
        if not self.executor.takes_guesses or layer >= self.n_layers or self.cfg.is_dense(layer):
            return None
        q = self.trunk.peek(layer)
        if q is None:
            self.lookahead_unready += 1
            return None
        c, k, pre = self.cfg, self.k, "block_sparse_moe."
        if blocks is not None and len(blocks):
            x = k.attn_res(blocks.sources(x), q["fold_mlp"], c.rms_eps)
        xn = k.rmsnorm(x, q["post_attention_layernorm.weight"], c.rms_eps)
        logits = k.matmul(q[pre + "gate.weight"], xn)
        idx, _ = k.router(logits, q[pre + "gate.e_score_correction_bias"], c.topk, c.moe_renorm,
                          c.routed_scale)
        return layer, [int(e) for e in idx.reshape(-1)]

    def hand_experts(self, executor: ExpertExecutor) -> None:
        """Routed experts computed by ``executor`` from now on (``k3core.cluster``; its maker
        closes it); the model's own executor stops."""
        self._local.close()
        self.executor = executor

    def close(self) -> None:
        """Stop the model's own executor's side thread, if one was started (the model stays
        usable: a later pass starts another)."""
        self._local.close()

    # ---- KDA (docs/model.md §5.4) ---------------------------------------------------------------
    def kda(self, p: LayerParams, x: np.ndarray, st: SequenceState) -> np.ndarray:
        c, k = self.cfg, self.k
        T, H, D = x.shape[0], c.kda_heads, c.kda_head_dim
        s = st.kda_state(p.layer)
        trail = st.trail  # a speculative pass: record what a rollback needs (model/rollback.py)
        hist0 = {n: h.copy() for n, h in s.conv.items()} if trail is not None else None
        # every projection of x in one call (q, k, v, beta, the gate's down-projection, g)
        names = ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_proj")
        rq, rk, rv, rb, fa, rg = k.matmul_many([p[f"self_attn.{n}.weight"] for n in names], x)
        qkv = {n: k.shortconv(raw, p[f"self_attn.{n}_conv1d.weight"], s.conv[n])
               for n, raw in zip("qkv", (rq, rk, rv), strict=True)}
        q = k.l2norm(qkv["q"].reshape(T, H, D)) * self.q_scale
        kk = k.l2norm(qkv["k"].reshape(T, H, D))
        v = qkv["v"].reshape(T, H, D)
        beta = k.sigmoid(rb)
        z = k.matmul(p["self_attn.f_b_proj.weight"], fa)
        alpha = k.kda_gate(z, p["self_attn.dt_bias"], p["self_attn.A_log"], c.gate_lb)
        if trail is None:
            o = k.kda_recurrent(q, kk, v, alpha.reshape(T, H, D), beta, s.S)
        else:
            assert hist0 is not None
            o = trail.kda(k, p.layer, s, hist0, (rq, rk, rv), q, kk, v, alpha.reshape(T, H, D), beta)
        o = k.rmsnorm(o, p["self_attn.o_norm.weight"], c.rms_eps).reshape(T, H * D)
        o = o * k.sigmoid(rg)
        return k.matmul(p["self_attn.o_proj.weight"], o)

    # ---- gated MLA, NoPE (docs/model.md §5.5) ---------------------------------------------------
    def mla(self, p: LayerParams, x: np.ndarray, st: SequenceState, keep: int | None = None
            ) -> np.ndarray:
        """Gated MLA over the rows of ``x``; with ``keep`` (the last layer of a pass), every
        row's latent still goes to the KV cache but only the last ``keep`` rows attend, and
        the output has those rows (each row's bits are the full pass's: attention is per
        query row over the cache up to its position)."""
        c, k = self.cfg, self.k
        T, H, n, r, dv = x.shape[0], c.n_heads, c.qk_nope, c.qk_rope, c.v_head
        q0 = T - keep if keep is not None and keep < T else 0  # the first row that attends
        ws = [p["self_attn.q_a_proj.weight"], p["self_attn.kv_a_proj_with_mqa.weight"]]
        if c.mla_out_gate:
            ws.append(p["self_attn.g_proj.weight"])
        if q0 == 0:  # the projections of x in one call: q down, kv down (+ rope key), output gate
            qa, ckv, *gate = k.matmul_many(ws, x)
        else:  # the latent of every row here; q and the gate below, of the rows that attend
            ckv = k.matmul(ws[1], x)
        # the cache holds the latent and the rope key; attention absorbs kv_b_proj (§5.5)
        latent = k.rmsnorm(np.ascontiguousarray(ckv[:, : c.kv_lora]), p["self_attn.kv_a_layernorm.weight"], c.rms_eps)
        cache = st.kv_cache(p.layer)
        a, b = st.pos, st.pos + T
        cache.rows[a:b, : c.kv_lora] = latent
        cache.rows[a:b, c.kv_lora :] = ckv[:, c.kv_lora :]
        if q0 == T:  # no row attends (a chunk before the one whose logits are asked)
            return np.empty((0, c.hidden), dtype=np.float32)
        if q0:
            qa, *gate = k.matmul_many([ws[0], *ws[2:]], x[q0:])
        cq = k.rmsnorm(qa, p["self_attn.q_a_layernorm.weight"], c.rms_eps)
        q = k.matmul(p["self_attn.q_b_proj.weight"], cq).reshape(T - q0, H, n + r)
        o = k.mla_latent_attention(q, cache.rows[:b], p["self_attn.kv_b_proj.weight"], a + q0, self.mla_scale)
        o = o.reshape(T - q0, H * dv)
        if c.mla_out_gate:
            o = o * k.sigmoid(gate[0])
        return k.matmul(p["self_attn.o_proj.weight"], o)

    # ---- MLPs (docs/model.md §5.6-5.7, SiTU §4.5) ---------------------------------------------------
    def situ_mlp(self, gate_w: U16 | F32 | Mxfp4, up_w: U16 | F32 | Mxfp4,
                 down_w: U16 | F32 | Mxfp4, x: F32) -> F32:
        return self.k.situ_mlp(gate_w, up_w, down_w, x, self.cfg.situ_b1, self.cfg.situ_b2)

    def dense_mlp(self, p: LayerParams, x: np.ndarray) -> np.ndarray:
        return self.situ_mlp(p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p["mlp.down_proj.weight"], x)

    def moe(self, p: LayerParams, x: np.ndarray,
            guess: tuple[int, list[int]] | None = None) -> np.ndarray:
        """The MoE block; the routed experts come from :attr:`executor` (computed while the
        shared experts run), ``guess`` (router lookahead) goes to it too."""
        c, k = self.cfg, self.k
        pre = "block_sparse_moe."
        # router gate and the latent down-projection read the same x: one call
        logits, z = k.matmul_many([p[pre + "gate.weight"], p[pre + "routed_expert_down_proj.weight"]], x)
        idx, w = k.router(logits, p[pre + "gate.e_score_correction_bias"], c.topk, c.moe_renorm, c.routed_scale)

        def shared_experts() -> np.ndarray:
            return self.situ_mlp(
                p[pre + "shared_experts.gate_proj.weight"],
                p[pre + "shared_experts.up_proj.weight"],
                p[pre + "shared_experts.down_proj.weight"],
                x,
            )

        outs, shared = self.executor.run(p.layer, idx, z,
                                         shared_experts if c.n_shared > 0 else None, guess)
        T = x.shape[0]
        acc = np.zeros((T, c.latent), dtype=np.float32)
        term = np.empty_like(acc)
        for j in range(c.topk):  # slot by slot from +0.0, each float32 term rounded first
            np.multiply(w[:, j : j + 1], outs[:, j], out=term)
            acc += term
        if c.latent_norm:
            acc = k.rmsnorm(acc, p[pre + "routed_expert_norm.weight"], c.rms_eps)
        y = k.matmul(p[pre + "routed_expert_up_proj.weight"], acc)
        return y if shared is None else y + shared
