"""Tensor names of the released checkpoint layout (docs/model.md §3).

Text tensors are prefixed ``language_model.model.`` except the head
(``language_model.lm_head.weight``). Inside k3 a layer's tensors are addressed by their
*suffix* after ``language_model.model.layers.{L}.`` (e.g. ``self_attn.q_proj.weight``).
"""

from __future__ import annotations

import re

PREFIX = "language_model.model."
LAYER_PREFIX = PREFIX + "layers."
EMBED = PREFIX + "embed_tokens.weight"
NORM = PREFIX + "norm.weight"
OUT_RES_NORM = PREFIX + "output_attn_res_norm.weight"
OUT_RES_PROJ = PREFIX + "output_attn_res_proj.weight"
LM_HEAD = "language_model.lm_head.weight"
MODEL_TABLES = (EMBED, NORM, OUT_RES_NORM, OUT_RES_PROJ, LM_HEAD)

EXPERT_RE = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale|weight)$")
_LAYER_RE = re.compile(r"^language_model\.model\.layers\.(\d+)\.(.+)$")

#: the six tensors of an MXFP4 expert, in on-disk order (w1, w2, w3; packed then scale)
EXPERT_PARTS = ("w1", "w2", "w3")


def layer_name(layer: int, suffix: str) -> str:
    return f"{LAYER_PREFIX}{layer}.{suffix}"


def expert_name(layer: int, expert: int, part: str, field: str) -> str:
    return layer_name(layer, f"block_sparse_moe.experts.{expert}.{part}.{field}")


def split_layer_name(name: str) -> tuple[int, str] | None:
    """``(layer, suffix)`` for a per-layer tensor name, else ``None``."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_routed_expert(suffix: str) -> bool:
    """True for a routed expert's tensor (streamed), False for trunk tensors.

    The shared experts live under ``shared_experts.`` and run on every token: they are trunk.
    """
    return EXPERT_RE.match(suffix) is not None


# ---- the oracle's underscore naming (fixtures/oracle, fixtures/ops layer fixtures) -----------
_ORACLE_SUFFIX = {
    "mlp_gate_weight": "block_sparse_moe.gate.weight",
    "mlp_e_score_correction_bias": "block_sparse_moe.gate.e_score_correction_bias",
    "mlp_down_weight": "block_sparse_moe.routed_expert_down_proj.weight",
    "mlp_up_weight": "block_sparse_moe.routed_expert_up_proj.weight",
    "mlp_norm_weight": "block_sparse_moe.routed_expert_norm.weight",
    "mlp_shared_w1_weight": "block_sparse_moe.shared_experts.gate_proj.weight",
    "mlp_shared_w3_weight": "block_sparse_moe.shared_experts.up_proj.weight",
    "mlp_shared_w2_weight": "block_sparse_moe.shared_experts.down_proj.weight",
    "mlp_gate_proj_weight": "mlp.gate_proj.weight",
    "mlp_up_proj_weight": "mlp.up_proj.weight",
    "mlp_down_proj_weight": "mlp.down_proj.weight",
    "input_layernorm_weight": "input_layernorm.weight",
    "post_attention_layernorm_weight": "post_attention_layernorm.weight",
    "self_attention_res_norm_weight": "self_attention_res_norm.weight",
    "self_attention_res_proj_weight": "self_attention_res_proj.weight",
    "mlp_res_norm_weight": "mlp_res_norm.weight",
    "mlp_res_proj_weight": "mlp_res_proj.weight",
    "self_attn_A_log": "self_attn.A_log",
    "self_attn_dt_bias": "self_attn.dt_bias",
}
_ORACLE_EXPERT = re.compile(r"^mlp_experts_(\d+)_(w[123])_weight$")
_ORACLE_ATTN = re.compile(r"^self_attn_(.+)_weight$")


def oracle_suffix(short: str) -> str:
    """Map an oracle name without its ``layers_{L}_`` prefix to the released suffix."""
    if short in _ORACLE_SUFFIX:
        return _ORACLE_SUFFIX[short]
    m = _ORACLE_EXPERT.match(short)
    if m:
        return f"block_sparse_moe.experts.{m.group(1)}.{m.group(2)}.weight"
    m = _ORACLE_ATTN.match(short)
    if m:
        return f"self_attn.{m.group(1)}.weight"
    raise KeyError(f"unknown oracle tensor name '{short}'")


ORACLE_MODEL = {
    "embed_tokens_weight": EMBED,
    "norm_weight": NORM,
    "output_attn_res_norm_weight": OUT_RES_NORM,
    "output_attn_res_proj_weight": OUT_RES_PROJ,
    "lm_head_weight": LM_HEAD,
}
