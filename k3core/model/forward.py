"""The Kimi K3 forward pass, written once against the kernel interface (docs/model.md §5).

The graph never asks which kernel backend, storage backend or cache policy it runs on. All
long reductions and transcendentals go through :class:`k3core.api.kernels.KernelBackend`;
the float32 adds and multiplies here are NumPy elementwise ops, which IEEE rounds
identically everywhere, so the logits are a function of the weights and the ids alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from k3core.api.errors import K3Error
from k3core.api.experts import ExpertExecutor, ExpertSource, ExpertWeights
from k3core.api.kernels import F32, U16, KernelBackend, Mxfp4
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams
from k3core.model.sources import ModelTables, TrunkSource
from k3core.model.state import SequenceState

LayerHook = Callable[[int, np.ndarray], None]


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
        self.experts = experts
        self.n_layers = n_layers or cfg.n_layers
        self.mla_scale = 1.0 / math.sqrt(cfg.qk_nope + cfg.qk_rope)
        self.q_scale = np.float32(1.0 / math.sqrt(cfg.kda_head_dim))
        self.layers_completed = 0
        self.on_layer: LayerHook | None = None
        #: full recompute reuses one KDA state slot across layers (ultra-low-memory)
        self.shared_kda_slot = False
        #: routed experts computed elsewhere (k3core.cluster); None computes them here
        self.executor: ExpertExecutor | None = None

    # ---- top level ------------------------------------------------------------------------
    def forward(self, ids: np.ndarray, state: SequenceState, all_logits: bool = False) -> np.ndarray:
        """Consume ``ids`` after ``state.pos`` positions; logits of the last (or every) position."""
        ids = np.asarray(ids, dtype=np.int64)
        T = ids.shape[0]
        state.check_room(T)
        self.layers_completed = 0
        self.experts.begin_step()
        h = self.tables.embed(ids)
        blocks: list[np.ndarray] = []
        for L in range(self.n_layers):
            p = self.trunk.acquire(L)
            try:
                h = self.layer(p, h, blocks, state)
            finally:
                self.trunk.release(L)
            self.layers_completed = L + 1
            if self.on_layer is not None:
                self.on_layer(L, h)
        h = self.k.attn_res(np.stack(blocks + [h]), self.tables.fold_out, self.cfg.rms_eps)
        last = h if all_logits else h[-1:]
        x = self.k.rmsnorm(last, self.tables.norm, self.cfg.rms_eps)
        logits = self.tables.logits(self.k, x)
        state.pos += T
        if not np.all(np.isfinite(logits)):
            raise K3Error("the forward pass produced non-finite logits; refusing to pick a token")
        return logits

    # ---- one decoder layer with block attention residuals (docs/model.md §5.2) ------------------
    def layer(self, p: LayerParams, h: np.ndarray, blocks: list[np.ndarray], st: SequenceState) -> np.ndarray:
        eps = self.cfg.rms_eps
        pref: np.ndarray | None = h
        x_a = self.k.attn_res(np.stack(blocks + [h]), p["fold_attn"], eps) if blocks else h
        if p.layer % self.cfg.attn_res_block == 0:
            blocks.append(h)
            pref = None
        xn = self.k.rmsnorm(x_a, p["input_layernorm.weight"], eps)
        a = self.mla(p, xn, st) if p.mla else self.kda(p, xn, st)
        self.trunk.begin_mlp(p.layer)  # a split layer's MLP part replaces its attention part
        pref = a if pref is None else pref + a
        x_m = self.k.attn_res(np.stack(blocks + [pref]), p["fold_mlp"], eps)
        xn = self.k.rmsnorm(x_m, p["post_attention_layernorm.weight"], eps)
        m = self.dense_mlp(p, xn) if p.dense else self.moe(p, xn)
        return pref + m

    # ---- KDA (docs/model.md §5.4) ---------------------------------------------------------------
    def kda(self, p: LayerParams, x: np.ndarray, st: SequenceState) -> np.ndarray:
        c, k = self.cfg, self.k
        T, H, D = x.shape[0], c.kda_heads, c.kda_head_dim
        s = st.kda_state(p.layer)
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
        o = k.kda_recurrent(q, kk, v, alpha.reshape(T, H, D), beta, s.S)
        o = k.rmsnorm(o, p["self_attn.o_norm.weight"], c.rms_eps).reshape(T, H * D)
        o = o * k.sigmoid(rg)
        return k.matmul(p["self_attn.o_proj.weight"], o)

    # ---- gated MLA, NoPE (docs/model.md §5.5) ---------------------------------------------------
    def mla(self, p: LayerParams, x: np.ndarray, st: SequenceState) -> np.ndarray:
        c, k = self.cfg, self.k
        T, H, n, r, dv = x.shape[0], c.n_heads, c.qk_nope, c.qk_rope, c.v_head
        # the projections of x in one call: q down, kv down (+ rope key), output gate
        ws = [p["self_attn.q_a_proj.weight"], p["self_attn.kv_a_proj_with_mqa.weight"]]
        if c.mla_out_gate:
            ws.append(p["self_attn.g_proj.weight"])
        qa, ckv, *gate = k.matmul_many(ws, x)
        cq = k.rmsnorm(qa, p["self_attn.q_a_layernorm.weight"], c.rms_eps)
        q = k.matmul(p["self_attn.q_b_proj.weight"], cq).reshape(T, H, n + r)
        latent = k.rmsnorm(np.ascontiguousarray(ckv[:, : c.kv_lora]), p["self_attn.kv_a_layernorm.weight"], c.rms_eps)
        kv = k.matmul(p["self_attn.kv_b_proj.weight"], latent).reshape(T, H, n + dv)
        cache = st.kv_cache(p.layer)
        a, b = st.pos, st.pos + T
        cache.k_nope[a:b] = kv[:, :, :n]
        cache.v[a:b] = kv[:, :, n:]
        cache.k_rope[a:b] = ckv[:, c.kv_lora :]
        o = k.mla_attention(q, cache.k_nope[:b], cache.k_rope[:b], cache.v[:b], a, self.mla_scale)
        o = o.reshape(T, H * dv)
        if c.mla_out_gate:
            o = o * k.sigmoid(gate[0])
        return k.matmul(p["self_attn.o_proj.weight"], o)

    # ---- MLPs (docs/model.md §5.6-5.7, SiTU §4.5) ---------------------------------------------------
    def situ_mlp(self, gate_w: U16 | F32 | Mxfp4, up_w: U16 | F32 | Mxfp4,
                 down_w: U16 | F32 | Mxfp4, x: F32) -> F32:
        return self.k.situ_mlp(gate_w, up_w, down_w, x, self.cfg.situ_b1, self.cfg.situ_b2)

    def dense_mlp(self, p: LayerParams, x: np.ndarray) -> np.ndarray:
        return self.situ_mlp(p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p["mlp.down_proj.weight"], x)

    def moe(self, p: LayerParams, x: np.ndarray) -> np.ndarray:
        c, k = self.cfg, self.k
        pre = "block_sparse_moe."
        # router gate and the latent down-projection read the same x: one call
        logits, z = k.matmul_many([p[pre + "gate.weight"], p[pre + "routed_expert_down_proj.weight"]], x)
        idx, w = k.router(logits, p[pre + "gate.e_score_correction_bias"], c.topk, c.moe_renorm, c.routed_scale)
        requests = [int(e) for e in idx.reshape(-1)]
        remote = self.executor.submit(p.layer, idx, z) if self.executor is not None else None
        if remote is None:
            self.experts.prefetch(p.layer, requests)
        shared = None
        if c.n_shared > 0:
            shared = self.situ_mlp(
                p[pre + "shared_experts.gate_proj.weight"],
                p[pre + "shared_experts.up_proj.weight"],
                p[pre + "shared_experts.down_proj.weight"],
                x,
            )
        T = x.shape[0]
        if remote is not None:
            outs = remote()  # the workers' outputs, waited for after the shared experts
        else:
            outs = np.empty((T, c.topk, c.latent), dtype=np.float32)

            def use(e: int, ew: ExpertWeights) -> None:
                rows, slots = np.nonzero(idx == e)
                outs[rows, slots] = self.situ_mlp(ew.w1, ew.w3, ew.w2, np.ascontiguousarray(z[rows]))

            self.experts.run_layer(p.layer, requests, use)
        acc = np.zeros((T, c.latent), dtype=np.float32)
        for j in range(c.topk):
            acc = acc + w[:, j : j + 1] * outs[:, j]
        if c.latent_norm:
            acc = k.rmsnorm(acc, p[pre + "routed_expert_norm.weight"], c.rms_eps)
        y = k.matmul(p[pre + "routed_expert_up_proj.weight"], acc)
        return y if shared is None else y + shared
