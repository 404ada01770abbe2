"""Per-sequence decoding state: KDA recurrent matrices, conv history, MLA latent KV cache.

One :class:`SequenceState` per sequence, so full recompute (a fresh state every step),
incremental decoding (one state carried across steps) and any later saved session share
the same object. The KV cache is allocated once for the whole request (its size is part
of the memory plan) and refuses to overflow rather than silently reuse rows.

``shared_kda_slot=True`` (ultra-low-memory, full recompute only) keeps one KDA slot and
clears it for each layer: in a single pass from position 0 a layer's recurrent state is
dead once the layer returns. Incremental decoding carries every layer's state to the next
step, so it still needs one slot per layer; a shared-slot state refuses a second pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from k3core.api.errors import K3Error
from k3core.api.kernels import KernelBackend
from k3core.api.prefault import hugepage_zeros
from k3core.model.config import ModelConfig


@dataclass
class KDAState:
    S: np.ndarray  # [H, D, D] float32, row = key channel
    conv: dict[str, np.ndarray]  # "q"/"k"/"v" -> [P, K-1] raw pre-conv inputs, oldest first


@dataclass
class KVCache:
    """One MLA layer's cache: per position the normed latent ``[kv_lora]`` then the shared
    rope key ``[qk_rope]``, float32 (``docs/model.md`` §6). Attention reads it through the
    absorbed kernel (``KernelBackend.mla_latent_attention``); nothing is expanded per head.
    Rows at and beyond ``SequenceState.pos`` are never read, so a rollback that lowers
    ``pos`` leaves them harmless (the next step overwrites them)."""

    rows: np.ndarray  # [cap, kv_lora + qk_rope]
    kv_lora: int

    @property
    def capacity(self) -> int:
        return int(self.rows.shape[0])

    @property
    def latent(self) -> np.ndarray:
        return self.rows[:, : self.kv_lora]

    @property
    def k_rope(self) -> np.ndarray:
        return self.rows[:, self.kv_lora :]


class VerifyTrail(Protocol):
    """What a speculative verify pass records per KDA layer (``k3core.model.rollback``)."""

    def kda(self, kern: KernelBackend, layer: int, s: KDAState, hist0: dict[str, np.ndarray],
            raw: tuple[np.ndarray, np.ndarray, np.ndarray], q: np.ndarray, k: np.ndarray,
            v: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray: ...


@dataclass
class SequenceState:
    """The carried state of one sequence; ``pos`` positions have been consumed."""

    cfg: ModelConfig
    capacity: int
    pos: int = 0
    kda: dict[int, KDAState] = field(default_factory=dict)
    kv: dict[int, KVCache] = field(default_factory=dict)
    shared_kda_slot: bool = False
    _shared_layer: int | None = field(default=None, repr=False)
    #: set during a speculative verify pass: what a rollback of its drafts needs
    trail: VerifyTrail | None = field(default=None, repr=False)

    def kda_state(self, layer: int) -> KDAState:
        if self.shared_kda_slot:
            return self._shared_kda(layer)
        st = self.kda.get(layer)
        if st is None:
            st = self.kda[layer] = _new_kda(self.cfg)
        return st

    def _shared_kda(self, layer: int) -> KDAState:
        if self.pos != 0:
            raise K3Error("a shared KDA slot serves one full-recompute pass from position 0; "
                          "incremental decoding needs one slot per layer")
        st = self.kda.get(-1)  # the one shared slot
        if st is None:
            st = self.kda[-1] = _new_kda(self.cfg)
        elif self._shared_layer != layer:
            st.S.fill(0)
            for h in st.conv.values():
                h.fill(0)
        self._shared_layer = layer
        return st

    def kv_cache(self, layer: int) -> KVCache:
        kv = self.kv.get(layer)
        if kv is None:
            c = self.cfg
            cap = self.capacity
            kv = KVCache(hugepage_zeros((cap, c.kv_lora + c.qk_rope), np.float32), c.kv_lora)
            self.kv[layer] = kv
        return kv

    def check_room(self, n_new: int) -> None:
        if self.pos + n_new > self.capacity:
            raise K3Error(
                f"KV cache overflow: {self.pos} positions cached + {n_new} new > capacity "
                f"{self.capacity}; refusing rather than overwriting cached positions"
            )


@dataclass
class StateSnapshot:
    """A copy of a :class:`SequenceState`'s consumed positions (:func:`snapshot`)."""

    pos: int
    kda: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]]
    kv: dict[int, np.ndarray]  # layer -> rows[:pos]


def snapshot(state: SequenceState) -> StateSnapshot:
    """A copy of what ``state`` holds after ``pos`` positions: every KDA layer's ``S`` and
    conv history, every MLA layer's first ``pos`` cache rows (the rows beyond are never
    read). Restoring it (:func:`restore`) gives the same bytes, so a sequence continued from
    a restored state gives the logits it gives from the original."""
    if state.shared_kda_slot:
        raise K3Error("a shared KDA slot (full recompute) carries no state to copy")
    return StateSnapshot(
        state.pos,
        {layer: (st.S.copy(), {n: h.copy() for n, h in st.conv.items()})
         for layer, st in state.kda.items()},
        {layer: kv.rows[: state.pos].copy() for layer, kv in state.kv.items()})


def restore(state: SequenceState, snap: StateSnapshot) -> None:
    """Put ``snap`` back into ``state`` (the same model's state, its capacity at least
    ``snap.pos``), in place: layers the snapshot lacks are dropped, the rest overwritten."""
    if snap.pos > state.capacity:
        raise K3Error(f"a snapshot of {snap.pos} positions does not fit a state of capacity "
                      f"{state.capacity}")
    for layer in [x for x in state.kda if x not in snap.kda]:
        del state.kda[layer]
    for layer in [x for x in state.kv if x not in snap.kv]:
        del state.kv[layer]
    for layer, (S, conv) in snap.kda.items():
        st = state.kda_state(layer)
        np.copyto(st.S, S)
        for n, h in conv.items():
            np.copyto(st.conv[n], h)
    for layer, rows in snap.kv.items():
        state.kv_cache(layer).rows[: snap.pos] = rows
    state.pos = snap.pos
    state.trail = None


def _new_kda(c: ModelConfig) -> KDAState:
    H, D, K = c.kda_heads, c.kda_head_dim, c.conv_k
    return KDAState(
        np.zeros((H, D, D), dtype=np.float32),
        {x: np.zeros((H * D, K - 1), dtype=np.float32) for x in "qkv"},
    )


def kv_bytes_per_position(cfg: ModelConfig) -> int:
    """Bytes of latent KV cache one position costs across all MLA layers (float32 latent
    plus rope key per layer)."""
    return 4 * (cfg.kv_lora + cfg.qk_rope) * cfg.n_mla


def expanded_kv_bytes_per_position(cfg: ModelConfig) -> int:
    """What one position would cost with per-head keys and values expanded through
    ``kv_b_proj`` (k_nope and v per head plus the rope key): the layout the latent replaces."""
    return 4 * (cfg.n_heads * (cfg.qk_nope + cfg.v_head) + cfg.qk_rope) * cfg.n_mla


def recurrent_bytes_per_layer(cfg: ModelConfig) -> int:
    """Bytes of KDA state plus conv history for one KDA layer."""
    P = cfg.kda_heads * cfg.kda_head_dim
    return 4 * (cfg.kda_heads * cfg.kda_head_dim**2 + 3 * P * (cfg.conv_k - 1))
