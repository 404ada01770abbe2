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
import threading
from collections.abc import Callable, Sequence

import numpy as np

from k3core.api.errors import UsageError
from k3core.api.experts import ExpertExecutor, ExpertSource
from k3core.api.kernels import (
    F32,
    U16,
    KdaSeq,
    KdaWeights,
    KernelBackend,
    MlaSeq,
    MlaWeights,
    Mxfp4,
    kda_mix_ops,
)
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams
from k3core.model.local_experts import LocalExperts
from k3core.model.residuals import BlockStack
from k3core.model.scheduler import Scheduler
from k3core.model.segments import Feed, Segments
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
        #: every pass goes through it: batched across the threads that ask at once
        self.scheduler = Scheduler(self)

    # ---- top level ------------------------------------------------------------------------
    def forward(self, ids: np.ndarray, state: SequenceState, all_logits: bool = False,
                tail: int = 1, cancel: threading.Event | None = None) -> np.ndarray:
        """Consume ``ids`` after ``state.pos`` positions; logits of the last ``tail`` (or
        every) position(s). Each row's logits are the bytes a one-row pass would give.

        Through :attr:`scheduler`: passes asked from several threads at once run together
        (:mod:`k3core.model.scheduler`), and a long ``ids`` is fed in chunks of at most
        :attr:`prefill_chunk` ids (each chunk carries the state to the next exactly as one
        pass would, and every op is per token or causal, so the logits are the one-pass
        logits; each routed expert is read once per chunk). ``cancel`` set ends it between
        two passes (``Cancelled``)."""
        ids = np.asarray(ids, dtype=np.int64)
        T = ids.shape[0]
        want = T if all_logits else max(1, min(tail, T))  # trailing rows whose logits are asked
        return self.scheduler.forward(Feed(ids, state, want), cancel)

    def forward_many(self, feeds: Sequence[Feed], new_step: bool = True) -> list[np.ndarray]:
        """One pass for several sequences at once (a batched step, docs/scheduler.md): each
        feed's ids after its own state's positions, the logits of its last ``rows`` rows.
        The trunk is acquired once per layer for all of them, the dense products take every
        row in one call, the routed experts of all rows are asked as one union; attention
        and the recurrence run per sequence. Each feed's logits are the bytes it gets in a
        pass of its own (every product is bit-identical row by row), unchecked: the caller
        refuses non-finite rows (:func:`checked`) feed by feed. ``new_step`` (False for the
        later chunks of one feed) tells the expert cache a step begins."""
        for f in feeds:
            f.state.check_room(len(f.ids))
        if new_step:
            self.executor.begin_step()
        self.chunks_last = 1
        return self._pass(list(feeds))

    def _pass(self, feeds: list[Feed]) -> list[np.ndarray]:
        """One pass over every layer for the feeds' ids; each feed's last ``rows`` rows'
        logits."""
        segs = Segments(feeds)
        T = segs.total
        self.layers_completed = 0
        h = self.tables.embed(segs.ids)
        c = self.cfg
        blocks = BlockStack(T, c.hidden, len(range(0, self.n_layers, c.attn_res_block)) + 1)
        for L in range(self.n_layers):
            p = self.trunk.acquire(L)
            # the last layer's MLP only for the rows whose logits are asked (unless a hook
            # watches every row of every layer): no later layer reads its other rows
            last = L == self.n_layers - 1 and self.on_layer is None
            try:
                h = self.layer(p, h, blocks, segs, last)
            finally:
                self.trunk.release(L)
            self.layers_completed = L + 1
            if self.on_layer is not None:
                self.on_layer(L, h)
        for f in feeds:
            f.state.pos += len(f.ids)
        kept = segs.kept_index()
        if not kept.size:
            return [np.empty((0, c.vocab), dtype=np.float32) for _ in feeds]
        if self.on_layer is not None and kept.size < T:  # every row went through the last
            h = h[kept]  # layer (a hook watched them): take the asked ones now
            blocks.keep_rows(kept)
        h = self.k.attn_res(blocks.sources(h), self.tables.fold_out, c.rms_eps)
        x = self.k.rmsnorm(h, self.tables.norm, c.rms_eps)
        out = self.tables.logits(self.k, x)
        return segs.split_kept(out)

    # ---- one decoder layer with block attention residuals (docs/model.md §5.2) ------------------
    def layer(self, p: LayerParams, h: np.ndarray, blocks: BlockStack, segs: Segments,
              last: bool = False) -> np.ndarray:
        """One layer over every row of ``h`` (the rows of ``segs``' sequences, one after the
        other); with ``last``, its attention still over every row (the KV caches and the KDA
        states take them all) and the rest only over each sequence's asked rows, ``blocks``
        cut to the same rows: every op after the attention is per row, so those rows' bits
        are the full layer's. The output then has only those rows."""
        eps, k = self.cfg.rms_eps, self.k
        pref: np.ndarray | None = h
        if len(blocks):  # the block attention residual and the norm in one call
            xn = k.attn_res_norm(blocks.sources(h), p["fold_attn"], p["input_layernorm.weight"], eps)
        else:
            xn = k.rmsnorm(h, p["input_layernorm.weight"], eps)
        if p.layer % self.cfg.attn_res_block == 0:
            blocks.append(h)
            pref = None
        T = xn.shape[0]
        keep = segs.kept_index() if last else None
        a = self.mla(p, xn, segs, keep) if p.mla else self.kda(p, xn, segs)
        self.trunk.begin_mlp(p.layer)  # a split layer's MLP part replaces its attention part
        if keep is not None and keep.size < T:
            if not p.mla:  # (an MLA layer's output has only those rows already)
                a = a[keep]
            pref = None if pref is None else pref[keep]
            blocks.keep_rows(keep)
            if not keep.size:  # no row asked (a chunk before the last): nothing reads it
                return a
        pref = a if pref is None else pref + a
        early: tuple[int, list[int]] | None = None
        route: list[np.ndarray] | None = None
        norm = p["post_attention_layernorm.weight"]
        if self.lookahead == "attn":  # the guess reads the residual before the norm
            x_m = k.attn_res(blocks.sources(pref), p["fold_mlp"], eps)
            early = self.guess(p.layer + 1, x_m)
            xn = k.rmsnorm(x_m, norm, eps)
        elif p.dense:
            xn = k.attn_res_norm(blocks.sources(pref), p["fold_mlp"], norm, eps)
        else:  # the MoE block's input, its router and its latent down-projection in one call
            c, pre = self.cfg, "block_sparse_moe."
            xn, idx, w_r, z = k.moe_route(
                blocks.sources(pref), p["fold_mlp"], norm, eps, p[pre + "gate.weight"],
                p[pre + "routed_expert_down_proj.weight"], p[pre + "gate.e_score_correction_bias"],
                c.topk, c.moe_renorm, c.routed_scale)
            route = [idx, w_r, z]
        if p.dense:
            m = self.dense_mlp(p, xn)
            if early is not None:
                self.executor.lookahead(*early)
        else:
            m = self.moe(p, xn, early, route)  # handed on behind the layer's own reads
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

    @property
    def expert_source(self) -> ExpertSource:
        """Where the model's own executor reads the routed experts (its figures: ``stats``)."""
        return self._local.source

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
    def kda(self, p: LayerParams, x: np.ndarray, segs: Segments) -> np.ndarray:
        """KDA over every row of ``x`` in one :meth:`KernelBackend.kda_mix` call: the
        projections and the gate take all rows, the short convolutions and the recurrence
        run per sequence on its own state. A speculative verify pass runs the same ops one
        by one (:func:`kda_mix_ops`) so that its sequences record what a rollback needs
        (``k3core/model/rollback.py``)."""
        k = self.k
        spans = list(segs.spans())
        states = [st.kda_state(p.layer) for _, _, st in spans]
        seqs = [KdaSeq(b - a, (s.conv["q"], s.conv["k"], s.conv["v"]), s.S)
                for (a, b, _), s in zip(spans, states, strict=True)]
        if all(st.trail is None for _, _, st in spans):
            return k.kda_mix(x, self.kda_weights(p), seqs)
        hists = [{n: h.copy() for n, h in s.conv.items()} for s in states]  # before the convs

        def recur(i: int, raw: tuple[np.ndarray, np.ndarray, np.ndarray], q: np.ndarray,
                  kk: np.ndarray, v: np.ndarray, alpha: np.ndarray, beta: np.ndarray
                  ) -> np.ndarray:
            trail, s = spans[i][2].trail, states[i]
            if trail is None:
                return k.kda_recurrent(q, kk, v, alpha, beta, s.S)
            return trail.kda(k, p.layer, s, hists[i], raw, q, kk, v, alpha, beta)

        return kda_mix_ops(k, x, self.kda_weights(p), seqs, recur)

    def kda_weights(self, p: LayerParams) -> KdaWeights:
        """A KDA layer's weights as :meth:`KernelBackend.kda_mix` takes them (made once per
        binding of the layer)."""
        w = p.memo.get("kda")
        if w is None:
            c, a = self.cfg, "self_attn."
            w = p.memo["kda"] = KdaWeights(
                proj=tuple(p[f"{a}{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "b_proj",
                                                          "f_a_proj", "g_proj")),
                f_b=p[a + "f_b_proj.weight"], dt_bias=p[a + "dt_bias"], a_log=p[a + "A_log"],
                conv=(p[a + "q_conv1d.weight"], p[a + "k_conv1d.weight"], p[a + "v_conv1d.weight"]),
                o_norm=p[a + "o_norm.weight"], o_proj=p[a + "o_proj.weight"],
                lower_bound=c.gate_lb, q_scale=float(self.q_scale), eps=c.rms_eps)
        return w

    # ---- gated MLA, NoPE (docs/model.md §5.5) ---------------------------------------------------
    def mla(self, p: LayerParams, x: np.ndarray, segs: Segments,
            keep: np.ndarray | None = None) -> np.ndarray:
        """Gated MLA over the rows of ``x``; with ``keep`` (the last layer of a pass: the rows
        whose logits are asked, each sequence's last ones), every row's latent still goes to
        its sequence's KV cache but only the ``keep`` rows attend, and the output has those
        rows (each row's bits are the full pass's: attention is per query row over its own
        cache up to its position). One :meth:`KernelBackend.mla_mix` call for every
        sequence of the pass."""
        part = keep is not None and keep.size < x.shape[0]
        seqs = [MlaSeq(b - a, st.kv_cache(p.layer).rows, st.pos, m)
                for (a, b, st), m in zip(segs.spans(), segs.attending(part), strict=True)]
        return self.k.mla_mix(x, self.mla_weights(p), seqs)

    def mla_weights(self, p: LayerParams) -> MlaWeights:
        """An MLA layer's weights as :meth:`KernelBackend.mla_mix` takes them (made once per
        binding of the layer); the cache holds the latent and the rope key, and attention
        absorbs ``kv_b_proj`` (§5.5)."""
        w = p.memo.get("mla")
        if w is None:
            c, a = self.cfg, "self_attn."
            w = p.memo["mla"] = MlaWeights(
                q_a=p[a + "q_a_proj.weight"], kv_a=p[a + "kv_a_proj_with_mqa.weight"],
                gate=p[a + "g_proj.weight"] if c.mla_out_gate else None,
                q_a_norm=p[a + "q_a_layernorm.weight"], kv_a_norm=p[a + "kv_a_layernorm.weight"],
                q_b=p[a + "q_b_proj.weight"], kv_b=p[a + "kv_b_proj.weight"],
                o_proj=p[a + "o_proj.weight"], kv_lora=c.kv_lora, heads=c.n_heads,
                scale=self.mla_scale, eps=c.rms_eps)
        return w

    # ---- MLPs (docs/model.md §5.6-5.7, SiTU §4.5) ---------------------------------------------------
    def situ_mlp(self, gate_w: U16 | F32 | Mxfp4, up_w: U16 | F32 | Mxfp4,
                 down_w: U16 | F32 | Mxfp4, x: F32) -> F32:
        return self.k.situ_mlp(gate_w, up_w, down_w, x, self.cfg.situ_b1, self.cfg.situ_b2)

    def dense_mlp(self, p: LayerParams, x: np.ndarray) -> np.ndarray:
        return self.situ_mlp(p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"], p["mlp.down_proj.weight"], x)

    def moe(self, p: LayerParams, x: np.ndarray, guess: tuple[int, list[int]] | None = None,
            route: Sequence[np.ndarray] | None = None) -> np.ndarray:
        """The MoE block over its input ``x``; the routed experts come from :attr:`executor`
        (computed while the shared experts run), ``guess`` (router lookahead) goes to it too.
        ``route``: the router's ``(idx, w)`` and the latent ``z`` of ``x`` when the caller
        has them (``KernelBackend.moe_route``)."""
        c, k = self.cfg, self.k
        pre = "block_sparse_moe."
        if route is None:  # router gate and the latent down-projection read the same x: one call
            logits, z = k.matmul_many([p[pre + "gate.weight"], p[pre + "routed_expert_down_proj.weight"]], x)
            idx, w = k.router(logits, p[pre + "gate.e_score_correction_bias"], c.topk,
                              c.moe_renorm, c.routed_scale)
        else:
            idx, w, z = route

        def shared_experts() -> np.ndarray:
            return self.situ_mlp(
                p[pre + "shared_experts.gate_proj.weight"],
                p[pre + "shared_experts.up_proj.weight"],
                p[pre + "shared_experts.down_proj.weight"],
                x,
            )

        outs, shared = self.executor.run(p.layer, idx, z,
                                         shared_experts if c.n_shared > 0 else None, guess)
        # slot by slot from +0.0, the latent norm, the up-projection, the shared experts
        norm = p[pre + "routed_expert_norm.weight"] if c.latent_norm else None
        return k.moe_combine(w, outs, norm, c.rms_eps, p[pre + "routed_expert_up_proj.weight"],
                             shared)
