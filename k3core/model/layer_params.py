"""Bind one layer's trunk tensors: check shapes and dtypes, widen small vectors, fold AttnRes.

``prepare_layer`` turns the raw arrays of a layer (as read from the checkpoint or a packed
trunk: bf16 as ``uint16`` bit patterns, ``float16``, ``float32``) into a :class:`LayerParams`
the model graph uses. Large matrices stay in their stored dtype (bf16 is widened inside the
matmul); small vectors become float32. A tensor of the wrong shape is refused by name:
a silently mis-bound layer produces fluent, wrong text.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from k3core.api.errors import CheckpointError
from k3core.model.config import ModelConfig

FLOAT_DTYPES = (np.uint16, np.float16, np.float32)


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Suffix -> shape of every trunk tensor layer ``layer`` must have (A_log checked apart)."""
    E, H, D = cfg.hidden, cfg.kda_heads, cfg.kda_head_dim
    P = H * D
    s: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (E,),
        "post_attention_layernorm.weight": (E,),
        "self_attention_res_norm.weight": (E,),
        "self_attention_res_proj.weight": (1, E),
        "mlp_res_norm.weight": (E,),
        "mlp_res_proj.weight": (1, E),
    }
    if cfg.is_mla(layer):
        Hm, n, r, dv = cfg.n_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head
        s.update(
            {
                "self_attn.q_a_proj.weight": (cfg.q_lora, E),
                "self_attn.q_a_layernorm.weight": (cfg.q_lora,),
                "self_attn.q_b_proj.weight": (Hm * (n + r), cfg.q_lora),
                "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora + r, E),
                "self_attn.kv_a_layernorm.weight": (cfg.kv_lora,),
                "self_attn.kv_b_proj.weight": (Hm * (n + dv), cfg.kv_lora),
                "self_attn.o_proj.weight": (E, Hm * dv),
            }
        )
        if cfg.mla_out_gate:
            s["self_attn.g_proj.weight"] = (Hm * dv, E)
    else:
        K = cfg.conv_k
        s.update(
            {
                "self_attn.q_proj.weight": (P, E),
                "self_attn.k_proj.weight": (P, E),
                "self_attn.v_proj.weight": (P, E),
                "self_attn.q_conv1d.weight": (P, 1, K),
                "self_attn.k_conv1d.weight": (P, 1, K),
                "self_attn.v_conv1d.weight": (P, 1, K),
                "self_attn.f_a_proj.weight": (D, E),
                "self_attn.f_b_proj.weight": (P, D),
                "self_attn.b_proj.weight": (H, E),
                "self_attn.dt_bias": (P,),
                "self_attn.g_proj.weight": (P, E),
                "self_attn.o_norm.weight": (D,),
                "self_attn.o_proj.weight": (E, P),
            }
        )
    if cfg.is_dense(layer):
        s.update(
            {
                "mlp.gate_proj.weight": (cfg.dense_inter, E),
                "mlp.up_proj.weight": (cfg.dense_inter, E),
                "mlp.down_proj.weight": (E, cfg.dense_inter),
            }
        )
    else:
        Lt = cfg.latent
        s.update(
            {
                "block_sparse_moe.gate.weight": (cfg.n_experts, E),
                "block_sparse_moe.gate.e_score_correction_bias": (cfg.n_experts,),
                "block_sparse_moe.routed_expert_down_proj.weight": (Lt, E),
                "block_sparse_moe.routed_expert_up_proj.weight": (E, Lt),
            }
        )
        if cfg.latent_norm:
            s["block_sparse_moe.routed_expert_norm.weight"] = (Lt,)
        if cfg.n_shared > 0:
            SI = cfg.moe_inter * cfg.n_shared
            s.update(
                {
                    "block_sparse_moe.shared_experts.gate_proj.weight": (SI, E),
                    "block_sparse_moe.shared_experts.up_proj.weight": (SI, E),
                    "block_sparse_moe.shared_experts.down_proj.weight": (E, SI),
                }
            )
    return s


def trunk_suffixes(cfg: ModelConfig, layer: int) -> list[str]:
    """Every trunk tensor suffix of a layer, A_log included for KDA layers."""
    names = list(expected_shapes(cfg, layer))
    if not cfg.is_mla(layer):
        names.append("self_attn.A_log")
    return names


def _vec(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).reshape(-1)
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1)


def _mat(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float16:
        a = a.astype(np.float32)
    return np.ascontiguousarray(a.reshape(a.shape[0], -1))


class LayerParams:
    """A bound layer: attribute access to prepared tensors (see ``prepare_layer``)."""

    def __init__(self, layer: int, mla: bool, dense: bool, tensors: dict[str, Any]):
        self.layer = layer
        self.mla = mla
        self.dense = dense
        self.t = tensors
        #: what the graph derives from the tensors once per binding (``Model.kda``'s
        #: weights bundle), dropped with the binding
        self.memo: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        return self.t[key]


def prepare_layer(cfg: ModelConfig, layer: int, raw: Mapping[str, np.ndarray]) -> LayerParams:
    """Check and prepare the trunk tensors of ``layer`` (suffix -> raw array)."""
    shapes = expected_shapes(cfg, layer)
    missing = [s for s in trunk_suffixes(cfg, layer) if s not in raw]
    if missing:
        raise CheckpointError(
            f"layer {layer}: missing tensor(s) {', '.join(missing[:6])}"
            + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        )
    t: dict[str, Any] = {}
    for suffix, shape in shapes.items():
        a = raw[suffix]
        if a.dtype.type not in FLOAT_DTYPES:
            raise CheckpointError(f"layer {layer}: {suffix} has dtype {a.dtype}, expected a float")
        if tuple(a.shape) != shape and not (
            suffix.endswith("conv1d.weight") and tuple(a.shape) == (shape[0], shape[2])
        ):
            raise CheckpointError(
                f"layer {layer}: {suffix} has shape {list(a.shape)}, expected {list(shape)}"
            )
        if len(shape) == 1 or suffix.endswith(("_res_proj.weight", "conv1d.weight")):
            t[suffix] = _vec(a)
        else:
            t[suffix] = _mat(a)
    finish_small(cfg, layer, t, raw.get("self_attn.A_log"))
    return LayerParams(layer, cfg.is_mla(layer), cfg.is_dense(layer), t)


def finish_small(cfg: ModelConfig, layer: int, t: dict[str, Any], a_log: np.ndarray | None) -> None:
    """The last step of binding a layer's small tensors, in place: a KDA layer's ``A_log``
    checked and trimmed to one value per head and its short-conv kernels reshaped, then the
    AttnRes folds (``fold_attn``, ``fold_mlp``). Shared by ``prepare_layer`` and the
    part-by-part binding of a streamed layer (``k3core.trunk.bind``)."""
    if not cfg.is_mla(layer):
        H = cfg.kda_heads
        if a_log is None:
            raise CheckpointError(f"layer {layer}: missing tensor(s) self_attn.A_log")
        if a_log.dtype.type not in FLOAT_DTYPES:
            raise CheckpointError(f"layer {layer}: self_attn.A_log has dtype {a_log.dtype}")
        a_log = _vec(a_log)
        if a_log.size < H:
            raise CheckpointError(
                f"layer {layer}: self_attn.A_log has {a_log.size} values, needs {H} (one per head)"
            )
        if np.any(a_log[H:] != 0):
            warnings.warn(
                f"layer {layer}: self_attn.A_log has non-zero values past head {H}; ignored",
                stacklevel=3,
            )
        t["self_attn.A_log"] = np.ascontiguousarray(a_log[:H])
        for c in ("q", "k", "v"):
            key = f"self_attn.{c}_conv1d.weight"
            t[key] = t[key].reshape(H * cfg.kda_head_dim, cfg.conv_k)
    t["fold_attn"] = t["self_attention_res_norm.weight"] * t["self_attention_res_proj.weight"]
    t["fold_mlp"] = t["mlp_res_norm.weight"] * t["mlp_res_proj.weight"]
