"""Named model shapes: the released Kimi K3 and the synthetic sizes `k3 synth` writes.

``tiny`` has the 13-layer shape of the reference oracle (two AttnRes blocks complete and a
third in progress, two MLA layers at the end); ``medium`` is hidden 1536, 25 layers, 64
experts, top-8 with the other widths scaled from the real model; ``real`` is Kimi K3 itself
(for planning only: writing it would take 1.5 TB).
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "rms_norm_eps": 1e-5,
    "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0,
    "mla_use_output_gate": True,
    "num_shared_experts": 2,
    "routed_scaling_factor": 1.0,
    "moe_renormalize": True,
    "latent_moe_use_norm": True,
    "first_k_dense_replace": 1,
    "situ_beta": 4.0,
    "situ_linear_beta": 25.0,
}


def _every(n: int, step: int) -> list[int]:
    """One-based MLA layers: every ``step``-th layer, and the last two (as in the real model)."""
    layers = set(range(step, n + 1, step)) | {n - 1, n}
    return sorted(layers)


SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128, "num_hidden_layers": 13, "vocab_size": 1024,
        "kda_num_heads": 4, "kda_head_dim": 16, "num_attention_heads": 4,
        "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "num_experts": 8, "num_experts_per_token": 2,
        "routed_expert_hidden_size": 64, "moe_intermediate_size": 64, "intermediate_size": 128,
        "attn_res_block_size": 3, "full_attn_layers": [4, 8, 12, 13],
    },
    "small": {
        "hidden_size": 512, "num_hidden_layers": 13, "vocab_size": 8192,
        "kda_num_heads": 8, "kda_head_dim": 64, "num_attention_heads": 8,
        "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
        "v_head_dim": 64, "num_experts": 32, "num_experts_per_token": 4,
        "routed_expert_hidden_size": 256, "moe_intermediate_size": 224, "intermediate_size": 2304,
        "attn_res_block_size": 3, "full_attn_layers": _every(13, 4),
    },
    "medium": {
        "hidden_size": 1536, "num_hidden_layers": 25, "vocab_size": 32768,
        "kda_num_heads": 12, "kda_head_dim": 128, "num_attention_heads": 12,
        "q_lora_rank": 320, "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "num_experts": 64, "num_experts_per_token": 8,
        "routed_expert_hidden_size": 768, "moe_intermediate_size": 672, "intermediate_size": 7232,
        "attn_res_block_size": 4, "full_attn_layers": _every(25, 4),
    },
    "real": {
        "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840,
        "kda_num_heads": 96, "kda_head_dim": 128, "num_attention_heads": 96,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "num_experts": 896, "num_experts_per_token": 16,
        "routed_expert_hidden_size": 3584, "moe_intermediate_size": 3072,
        "intermediate_size": 33792, "attn_res_block_size": 12, "full_attn_layers": _every(93, 4),
    },
}


def size_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The flat config dict of a named size with ``overrides`` applied."""
    d = dict(_COMMON)
    d.update(SIZES[name])
    d.update(overrides or {})
    return d
