"""The Kimi K3 graph in PyTorch, exactly as k3 computes it (k3core/model/forward.py), fp32.

Every tensor is a parameter (or, for the router's score-correction bias, a buffer) named by
its released suffix, so loading a checkpoint in the released layout and exporting one are
renames only. Routed experts are stacked per layer (``experts.w1`` is ``[Ne, I, Lt]``);
``quant`` switches them to MXFP4 fake quantisation (straight-through) for
quantisation-aware training and for evaluating exactly what the export holds.

Nothing in k3core imports this module; it needs ``torch`` (the ``[train]`` extra).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3core.model.config import ModelConfig
from k3core.model.layer_params import expected_shapes

L2_EPS = 1e-6
ROUTER_EPS = 1e-20
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _key(name: str) -> str:
    return name.replace(".", "__")


def rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def situ(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def attn_res(sources: list[torch.Tensor], fold: torch.Tensor, eps: float) -> torch.Tensor:
    v = torch.stack(sources)  # [S, ..., E]
    score = (rmsnorm(v, None, eps) * fold).sum(-1)  # [S, ...]
    p = torch.softmax(score, dim=0)
    return (p.unsqueeze(-1) * v).sum(0)


def mxfp4_fake(w: torch.Tensor) -> torch.Tensor:
    """Round ``w`` (rows x cols, cols % 32 == 0) to MXFP4 values; see :func:`mxfp4_codes`."""
    codes, exps = mxfp4_codes(w)
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=w.dtype, device=w.device)
    vals = table[codes.long()].reshape(*w.shape[:-1], -1, 32)
    return (vals * torch.exp2(exps.to(w.dtype)).unsqueeze(-1)).reshape(w.shape)


def mxfp4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit E2M1 codes (bit 3 = sign) and per-32 exponents of ``w``, least-squares per group.

    For each group of 32 inputs two shared exponents are tried, ``floor(log2(amax)) - 2``
    (the OCP choice; values above 6 * 2^e clip to 6) and one more (no clipping), each value
    rounded to the nearest E2M1 magnitude; the one with the smaller squared error wins.
    """
    with torch.no_grad():
        g = w.detach().float().reshape(*w.shape[:-1], -1, 32)
        amax = g.abs().amax(-1)
        base = torch.floor(torch.log2(amax.clamp_min(2.0**-120))) - 2
        mags = torch.tensor(E2M1, dtype=torch.float32, device=w.device)
        best_err = best_codes = best_e = None
        for e in (base, base + 1):
            e = e.clamp(-127, 127)
            x = g / torch.exp2(e).unsqueeze(-1)
            idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(-1)
            q = mags[idx] * torch.sign(x)
            err = ((q - x) ** 2 * torch.exp2(2 * e).unsqueeze(-1)).sum(-1)
            codes = idx + 8 * (x < 0)
            codes = torch.where(idx == 0, torch.zeros_like(codes), codes)
            if best_err is None:
                best_err, best_codes, best_e = err, codes, e
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
                best_e = torch.where(better, e, best_e)
        assert best_codes is not None and best_e is not None
        return best_codes.reshape(w.shape).to(torch.uint8), best_e


class K3(nn.Module):
    """One K3 model: ``forward(ids [B, T]) -> logits [B, T, V]``."""

    def __init__(self, cfg: ModelConfig, init_std: float = 0.02, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.params = nn.ParameterDict()
        self.quant = False
        #: KDA in chunks of this many steps (0: step by step); both are the same math
        self.chunk = 16
        self.load_counts: list[torch.Tensor | None] = [None] * cfg.n_layers
        gen = torch.Generator().manual_seed(seed)
        c = cfg
        E, V = c.hidden, c.vocab

        def add(name: str, shape: tuple[int, ...], kind: str = "matrix") -> None:
            if kind == "ones":
                t = torch.ones(shape)
            elif kind == "zeros":
                t = torch.zeros(shape)
            else:
                t = torch.randn(shape, generator=gen) * init_std
            self.params[_key(name)] = nn.Parameter(t)

        add("embed_tokens.weight", (V, E))
        add("lm_head.weight", (V, E))
        add("norm.weight", (E,), "ones")
        add("output_attn_res_norm.weight", (E,), "ones")
        add("output_attn_res_proj.weight", (1, E), "zeros")
        for L in range(c.n_layers):
            for suffix, shape in expected_shapes(c, L).items():
                name = f"layers.{L}.{suffix}"
                if suffix.endswith("e_score_correction_bias"):
                    self.register_buffer(_key(name), torch.zeros(shape))
                elif suffix.endswith("_res_proj.weight"):
                    add(name, shape, "zeros")  # AttnRes starts as a uniform mixture
                elif len(shape) == 1:
                    add(name, shape, "ones")
                elif suffix.endswith("conv1d.weight"):
                    t = torch.zeros(shape)
                    t[..., -1] = 1.0  # identity conv at start
                    t += torch.randn(shape, generator=gen) * 0.1
                    self.params[_key(name)] = nn.Parameter(t)
                else:
                    add(name, shape)
            if not c.is_mla(L):
                H, D = c.kda_heads, c.kda_head_dim
                self.params[_key(f"layers.{L}.self_attn.A_log")] = nn.Parameter(
                    torch.linspace(-0.4, 1.2, H))
                self.params[_key(f"layers.{L}.self_attn.dt_bias")] = nn.Parameter(
                    torch.randn(H * D, generator=gen) * 0.5)
            if not c.is_dense(L):
                Ne, Im, Lt = c.n_experts, c.moe_inter, c.latent
                for part, shape in (("w1", (Ne, Im, Lt)), ("w3", (Ne, Im, Lt)),
                                    ("w2", (Ne, Lt, Im))):
                    add(f"layers.{L}.block_sparse_moe.experts.{part}", shape)
        # residual-branch outputs start small (a common, harmless init choice)
        for L in range(c.n_layers):
            for suffix in ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                           "block_sparse_moe.routed_expert_up_proj.weight",
                           "block_sparse_moe.shared_experts.down_proj.weight"):
                k = _key(f"layers.{L}.{suffix}")
                if k in self.params:
                    with torch.no_grad():
                        self.params[k].mul_(1.0 / math.sqrt(2 * c.n_layers))

    # ---- access --------------------------------------------------------------------------
    def P(self, name: str) -> torch.Tensor:
        k = _key(name)
        if k in self.params:
            return self.params[k]
        return getattr(self, k)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer under its dotted name."""
        out = {k.replace("__", "."): v for k, v in self.params.items()}
        out.update({k.replace("__", "."): v for k, v in self.named_buffers()})
        return out

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        eps = c.rms_eps
        h = self.P("embed_tokens.weight")[ids]
        blocks: list[torch.Tensor] = []
        for L in range(c.n_layers):
            h = self.layer(L, h, blocks)
        h = attn_res(blocks + [h], self.fold("output_attn_res"), eps)
        x = rmsnorm(h, self.P("norm.weight"), eps)
        return x @ self.P("lm_head.weight").t()

    def fold(self, prefix: str) -> torch.Tensor:
        return self.P(f"{prefix}_norm.weight") * self.P(f"{prefix}_proj.weight").reshape(-1)

    def layer(self, L: int, h: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        c = self.cfg
        eps = c.rms_eps
        pre = f"layers.{L}."
        pref: torch.Tensor | None = h
        x_a = attn_res(blocks + [h], self.fold(pre + "self_attention_res"), eps) if blocks else h
        if L % c.attn_res_block == 0:
            blocks.append(h)
            pref = None
        xn = rmsnorm(x_a, self.P(pre + "input_layernorm.weight"), eps)
        a = self.mla(L, xn) if c.is_mla(L) else self.kda(L, xn)
        pref = a if pref is None else pref + a
        x_m = attn_res(blocks + [pref], self.fold(pre + "mlp_res"), eps)
        xn = rmsnorm(x_m, self.P(pre + "post_attention_layernorm.weight"), eps)
        m = self.dense(L, xn) if c.is_dense(L) else self.moe(L, xn)
        return pref + m

    def lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.P(name).t()

    # ---- KDA --------------------------------------------------------------------------------
    def kda(self, L: int, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        B, T, _ = x.shape
        H, D, K = c.kda_heads, c.kda_head_dim, c.conv_k
        pre = f"layers.{L}.self_attn."
        qkv = []
        for n in "qkv":
            raw = self.lin(pre + f"{n}_proj.weight", x).transpose(1, 2)  # [B, P, T]
            w = self.P(pre + f"{n}_conv1d.weight").reshape(H * D, 1, K)
            y = F.conv1d(F.pad(raw, (K - 1, 0)), w, groups=H * D)
            qkv.append(F.silu(y).transpose(1, 2).reshape(B, T, H, D))
        q, k, v = qkv

        def l2(t: torch.Tensor) -> torch.Tensor:
            return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + L2_EPS)

        q = l2(q) * (1.0 / math.sqrt(D))
        k = l2(k)
        beta = torch.sigmoid(self.lin(pre + "b_proj.weight", x))  # [B, T, H]
        z = self.lin(pre + "f_b_proj.weight", self.lin(pre + "f_a_proj.weight", x))
        a = torch.exp(self.P(pre + "A_log")[:H]).repeat_interleave(D)
        g = c.gate_lb * torch.sigmoid(a * (z + self.P(pre + "dt_bias")))
        g = g.reshape(B, T, H, D)
        if self.chunk and T % self.chunk == 0:
            o = kda_chunked(q, k, v, g, beta, self.chunk)
        else:
            o = kda_recurrence(q, k, v, torch.exp(g), beta)
        o = rmsnorm(o, self.P(pre + "o_norm.weight"), c.rms_eps).reshape(B, T, H * D)
        o = o * torch.sigmoid(self.lin(pre + "g_proj.weight", x))
        return self.lin(pre + "o_proj.weight", o)

    # ---- MLA --------------------------------------------------------------------------------
    def mla(self, L: int, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        B, T, _ = x.shape
        H, n, r, dv = c.n_heads, c.qk_nope, c.qk_rope, c.v_head
        pre = f"layers.{L}.self_attn."
        cq = rmsnorm(self.lin(pre + "q_a_proj.weight", x), self.P(pre + "q_a_layernorm.weight"),
                     c.rms_eps)
        q = self.lin(pre + "q_b_proj.weight", cq).reshape(B, T, H, n + r)
        ckv = self.lin(pre + "kv_a_proj_with_mqa.weight", x)
        latent = rmsnorm(ckv[..., : c.kv_lora], self.P(pre + "kv_a_layernorm.weight"), c.rms_eps)
        kv = self.lin(pre + "kv_b_proj.weight", latent).reshape(B, T, H, n + dv)
        k_rope = ckv[..., c.kv_lora :].unsqueeze(2).expand(B, T, H, r)
        keys = torch.cat([kv[..., :n], k_rope], dim=-1)
        vals = kv[..., n:]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
            is_causal=True, scale=1.0 / math.sqrt(n + r))
        o = o.transpose(1, 2).reshape(B, T, H * dv)
        if c.mla_out_gate:
            o = o * torch.sigmoid(self.lin(pre + "g_proj.weight", x))
        return self.lin(pre + "o_proj.weight", o)

    # ---- MLPs -------------------------------------------------------------------------------
    def situ_mlp(self, pre: str, gate: str, up: str, down: str, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        a = situ(self.lin(pre + gate, x), self.lin(pre + up, x), c.situ_b1, c.situ_b2)
        return self.lin(pre + down, a)

    def dense(self, L: int, x: torch.Tensor) -> torch.Tensor:
        return self.situ_mlp(f"layers.{L}.mlp.", "gate_proj.weight", "up_proj.weight",
                             "down_proj.weight", x)

    def expert_weights(self, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre = f"layers.{L}.block_sparse_moe.experts."
        ws = [self.P(pre + p) for p in ("w1", "w3", "w2")]
        if self.quant:
            ws = [w + (mxfp4_fake(w) - w).detach() for w in ws]
        return ws[0], ws[1], ws[2]

    def moe(self, L: int, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        pre = f"layers.{L}.block_sparse_moe."
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        s = torch.sigmoid(self.lin(pre + "gate.weight", xf))
        sel = s + self.P(pre + "gate.e_score_correction_bias")
        idx = torch.topk(sel.detach(), c.topk, dim=-1).indices  # [N, k]
        w = s.gather(1, idx)
        if c.topk > 1 and c.moe_renorm:
            w = w / (w.sum(-1, keepdim=True) + ROUTER_EPS)
        w = w * c.routed_scale
        if self.training:
            self.load_counts[L] = torch.bincount(idx.reshape(-1), minlength=c.n_experts).detach()
        z = self.lin(pre + "routed_expert_down_proj.weight", xf)  # [N, Lt]
        w1, w3, w2 = self.expert_weights(L)
        unsorted = routed_experts(z, idx, w1, w3, w2, c.situ_b1, c.situ_b2)
        acc = (w.unsqueeze(-1) * unsorted).sum(1)
        if c.latent_norm:
            acc = rmsnorm(acc, self.P(pre + "routed_expert_norm.weight"), c.rms_eps)
        y = self.lin(pre + "routed_expert_up_proj.weight", acc)
        if c.n_shared > 0:
            y = y + self.situ_mlp(pre + "shared_experts.", "gate_proj.weight", "up_proj.weight",
                                  "down_proj.weight", xf)
        return y.reshape(shape)

    @torch.no_grad()
    def balance_router(self, rate: float) -> None:
        """The model family's bias balancing: raise the bias of under-loaded experts."""
        for L, counts in enumerate(self.load_counts):
            if counts is None:
                continue
            b = self.P(f"layers.{L}.block_sparse_moe.gate.e_score_correction_bias")
            load = counts.float()
            b += rate * torch.sign(load.mean() - load)
            self.load_counts[L] = None


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
    """Gated delta rule, per head: decay rows, read, write, read out (`docs/model.md`, section 5.4).

    Shapes: q, k, v, alpha ``[B, T, H, D]``; beta ``[B, T, H]``; returns ``[B, T, H, D]``.
    """
    B, T, H, D = q.shape
    S = q.new_zeros(B, H, D, D)
    outs = []
    for t in range(T):
        S = S * alpha[:, t].unsqueeze(-1)
        kt = k[:, t]
        u = torch.einsum("bhi,bhij->bhj", kt, S)
        S = S + kt.unsqueeze(-1) * (beta[:, t, :, None] * (v[:, t] - u)).unsqueeze(-2)
        outs.append(torch.einsum("bhi,bhij->bhj", q[:, t], S))
    return torch.stack(outs, dim=1)


def routed_experts(z: torch.Tensor, idx: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """Each token's ``k`` expert outputs ``[N, k, Lt]``: assignments grouped by expert, then
    each chosen expert's three products over exactly its rows (no padding, so an unbalanced
    router costs no more than a balanced one; the same sums as one product per assignment)."""
    N, k = idx.shape
    Ne = w1.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=Ne).tolist()
    zs = z[order // k]
    outs = []
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        seg = zs[start : start + c]
        start += c
        a = situ(seg @ w1[e].t(), seg @ w3[e].t(), b1, b2)
        outs.append(a @ w2[e].t())
    out = torch.cat(outs)  # [N*k, Lt] in sorted order
    unsorted = torch.empty_like(out).index_copy(0, order, out)
    return unsorted.reshape(N, k, -1)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """The same recurrence as :func:`kda_recurrence` in chunks (exact math, for training).

    With G the within-chunk cumulative log-decay, the state before step t is
    ``S_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t-G_s} k_s d_s^T`` (rows scaled per key
    channel), so the deltas d solve the unit lower-triangular system
    ``(I + diag(beta) A) d = diag(beta) (v - (k e^{G}) S_0)`` with
    ``A[t, s] = sum_i k_t[i] k_s[i] e^{G_t[i] - G_s[i]}`` (s < t), and the outputs are
    ``o_t = (q_t e^{G_t}) S_0 + sum_{s<=t} Aq[t, s] d_s``. ``g`` is log(alpha), ``[B, T, H, D]``.
    """
    B, T, H, D = q.shape
    assert T % chunk == 0, "sequence length must be a multiple of the chunk"
    n = T // chunk

    def split(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, n, C, ...]
        return x.reshape(B, n, chunk, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    q, k, v, g, beta = split(q), split(k), split(v), split(g), split(beta)
    G = torch.cumsum(g, dim=3)  # [B, H, n, C, D]
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    strict = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
    # e^{G_t - G_s} = e^{G_t - G_m} e^{G_m - G_s} around the chunk's middle step m, so each
    # factor stays within e^{+-chunk*|gate_lb|/2}; entries with s > t are masked away
    Gm = G[:, :, :, chunk // 2 - 1 : chunk // 2]
    k_in = k * torch.exp(Gm - G)
    kk = (k * torch.exp(G - Gm)) @ k_in.transpose(-1, -2)
    kk = kk.masked_fill(~strict, 0.0)
    qk = ((q * torch.exp(G - Gm)) @ k_in.transpose(-1, -2)).masked_fill(~causal, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype)
    M = eye + beta.unsqueeze(-1) * kk
    kG = k * torch.exp(G)
    qG = q * torch.exp(G)
    rhs_v = torch.linalg.solve_triangular(M, beta.unsqueeze(-1) * v, upper=False,
                                          unitriangular=True)
    rhs_k = torch.linalg.solve_triangular(M, beta.unsqueeze(-1) * kG, upper=False,
                                          unitriangular=True)
    k_end = k * torch.exp(G[:, :, :, -1:] - G)  # decay from s to the chunk's end
    a_end = torch.exp(G[:, :, :, -1])  # [B, H, n, D]
    S = q.new_zeros(B, H, D, D)
    outs = []
    for c in range(n):
        d = rhs_v[:, :, c] - rhs_k[:, :, c] @ S  # [B, H, C, D]
        outs.append(qG[:, :, c] @ S + qk[:, :, c] @ d)
        S = a_end[:, :, c].unsqueeze(-1) * S + k_end[:, :, c].transpose(-1, -2) @ d
    o = torch.stack(outs, dim=2)  # [B, H, n, C, D]
    return o.transpose(2, 3).transpose(1, 3).reshape(B, T, H, D)
