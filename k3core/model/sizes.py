"""How many bytes each part of a model occupies: per-layer trunk, model tables, one expert.

Two sources, one record:

* :func:`sizes_from_config` plans from ``config.json`` alone, with the released dtypes
  (docs/model.md §3: bf16 matrices and norm gains; f32 conv kernels, ``A_log`` padded to
  ``head_dim``, ``dt_bias``, ``o_norm`` and the router's correction bias; MXFP4 experts at
  0.53125 bytes per weight). For Kimi K3 this gives exactly the released figures: a
  108,811,877,376-byte trunk, 4,697,663,488 bytes of tables, 17,547,264 bytes per expert.
* :func:`sizes_from_index` counts what the shards really hold (``k3 budget``, ``k3 doctor``).

The memory plan and the ``auto`` preset only ever see a :class:`ModelSizes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3core.api.units import ALIGN, align_up
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import expected_shapes

#: one routed expert of the released Kimi K3: w1, w3 (3072 x 3584) and w2 (3584 x 3072) in
#: MXFP4, packed nibbles plus E8M0 scales; :func:`sizes_from_config` derives the same figure
EXPERT_BYTES = 17_547_264
#: suffixes held as float32 in the released checkpoint (everything else 1-D is bf16)
_F32_SUFFIXES = (
    "conv1d.weight",
    "self_attn.dt_bias",
    "self_attn.o_norm.weight",
    "block_sparse_moe.gate.e_score_correction_bias",
)


def slot_bytes(expert_bytes: int) -> int:
    """One expert-cache slot: the expert plus one alignment unit, rounded up to ``ALIGN``.

    The extra unit lets an expert sit in its slot at the same offset modulo 4096 as in its
    file, so an O_DIRECT read lands in place. The cache allocates this stride and the memory
    plan counts it: both call this function (``0`` for a model without experts).
    """
    return align_up(expert_bytes + ALIGN) if expert_bytes > 0 else 0


def cache_slots(cache_bytes: int, expert_bytes: int, most: int) -> int:
    """Whole slots a cache budget of ``cache_bytes`` holds, never more than ``most``."""
    stride = slot_bytes(expert_bytes)
    return min(cache_bytes // stride, most) if stride else 0


@dataclass(frozen=True)
class ModelSizes:
    """Byte sizes a memory plan needs; ``layer_bytes[L]`` is layer L's trunk run."""

    layer_bytes: tuple[int, ...]
    tables_bytes: int  # embedding + lm_head + final/model-level vectors
    embed_row_bytes: int  # one embedding row (ultra streams rows)
    expert_bytes: int  # one routed expert, all six tensors
    n_moe_layers: int
    n_experts: int
    topk: int
    source: str = "config"

    @property
    def trunk_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def largest_layer(self) -> int:
        return max(self.layer_bytes) if self.layer_bytes else 0

    @property
    def expert_slot_bytes(self) -> int:
        """One expert-cache slot for this model's expert (:func:`slot_bytes`)."""
        return slot_bytes(self.expert_bytes)

    @property
    def expert_pool_bytes(self) -> int:
        """Every routed expert of every MoE layer, at slot size (the most a cache can use)."""
        return self.expert_slot_bytes * self.n_experts * self.n_moe_layers

    @property
    def expert_bytes_per_token(self) -> int:
        """Routed-expert bytes one token reads with no cache hits."""
        return self.topk * self.n_moe_layers * self.expert_bytes

    def first(self, n_layers: int) -> ModelSizes:
        """The sizes of a run over only the first ``n_layers`` layers."""
        kept = self.layer_bytes[:n_layers]
        moe = min(self.n_moe_layers, max(0, n_layers - (len(self.layer_bytes) - self.n_moe_layers)))
        return ModelSizes(kept, self.tables_bytes, self.embed_row_bytes, self.expert_bytes,
                          moe, self.n_experts, self.topk, self.source)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def planned_tensor_bytes(suffix: str, shape: tuple[int, ...]) -> int:
    """Released-dtype size of one trunk tensor."""
    f32 = suffix.endswith(_F32_SUFFIXES) or suffix == "self_attn.A_log"
    return _numel(shape) * (4 if f32 else 2)


def mxfp4_bytes(rows: int, cols: int) -> int:
    """Packed nibbles plus one E8M0 scale byte per 32 inputs."""
    return rows * cols // 2 + rows * cols // 32


def sizes_from_config(cfg: ModelConfig) -> ModelSizes:
    """Plan every size from the config and the released dtypes."""
    layers = []
    for L in range(cfg.n_layers):
        total = sum(planned_tensor_bytes(s, shape) for s, shape in expected_shapes(cfg, L).items())
        if not cfg.is_mla(L):
            total += planned_tensor_bytes("self_attn.A_log", (max(cfg.kda_heads, cfg.kda_head_dim),))
        layers.append(total)
    E, V = cfg.hidden, cfg.vocab
    tables = 2 * V * E * 2 + 3 * E * 2
    expert = 2 * mxfp4_bytes(cfg.moe_inter, cfg.latent) + mxfp4_bytes(cfg.latent, cfg.moe_inter)
    n_moe = sum(1 for L in range(cfg.n_layers) if not cfg.is_dense(L))
    return ModelSizes(tuple(layers), tables, E * 2, expert, n_moe, cfg.n_experts, cfg.topk,
                      "config")


def sizes_from_index(cfg: ModelConfig, tensors: dict[str, int], dtype_bytes: int = 2) -> ModelSizes:
    """Count real sizes from ``{tensor name: nbytes}`` (e.g. a checkpoint index).

    Trunk = every per-layer tensor that is not a routed expert (shared experts included);
    tables = the five model-level tensors; the expert size is the largest routed expert found.
    ``dtype_bytes`` sizes one embedding row (the embedding's element size).
    """
    layer_bytes = [0] * cfg.n_layers
    experts: dict[tuple[int, str], int] = {}
    tables = 0
    for name, nbytes in tensors.items():
        if name in names.MODEL_TABLES:
            tables += nbytes
            continue
        split = names.split_layer_name(name)
        if split is None or not 0 <= split[0] < cfg.n_layers:
            continue
        layer, suffix = split
        m = names.EXPERT_RE.match(suffix)
        if m:
            key = (layer, m.group(1))
            experts[key] = experts.get(key, 0) + nbytes
        else:
            layer_bytes[layer] += nbytes
    n_moe = sum(1 for L in range(cfg.n_layers) if not cfg.is_dense(L))
    expert = max(experts.values(), default=0)
    return ModelSizes(tuple(layer_bytes), tables, cfg.hidden * dtype_bytes, expert, n_moe,
                      cfg.n_experts, cfg.topk, "index")
