"""Size checks made from the checkpoint's headers before any tensor is read.

The safetensors reader already refuses a tensor whose byte range is not inside its file,
so no header can make k3 allocate more than the file holds. But a file can be sparse (a
1 TB hole costs nothing on disk), and the binder used to learn a tensor's shape only from
the array it had just read. :func:`check_bind_shapes` compares every tensor the run will
read at bind time (the trunk of the layers run and the model tables) with the shape and
dtype the config implies, from the index alone, so a tensor claiming terabytes is refused
with the binder's own message (``CheckpointError``, exit 1) before a byte is allocated.
Missing tensors are left to the binder, which names them with a hint.
"""

from __future__ import annotations

from k3core.api.errors import CheckpointError
from k3core.checkpoint.index import CheckpointIndex, TensorInfo
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import expected_shapes

FLOAT_DTYPES = ("BF16", "F16", "F32")


def check_bind_shapes(cfg: ModelConfig, index: CheckpointIndex, n_layers: int) -> None:
    """Refuse, before reading, any bind-time tensor whose shape or dtype is not the config's."""
    for layer in range(n_layers):
        for suffix, shape in expected_shapes(cfg, layer).items():
            t = _info(index, names.layer_name(layer, suffix))
            if t is None:
                continue
            if t.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"layer {layer}: {suffix} has dtype {t.dtype}, "
                                      "expected a float (BF16, F16 or F32)")
            conv = suffix.endswith("conv1d.weight") and t.shape == (shape[0], shape[2])
            if t.shape != shape and not conv:
                raise CheckpointError(f"layer {layer}: {suffix} has shape {list(t.shape)}, "
                                      f"expected {list(shape)}")
        if not cfg.is_mla(layer):
            t = _info(index, names.layer_name(layer, "self_attn.A_log"))
            limit = max(cfg.kda_heads, cfg.kda_head_dim)
            if t is not None and t.numel > limit:
                raise CheckpointError(f"layer {layer}: self_attn.A_log has {t.numel} values; "
                                      f"one per head (padded to at most {limit}) is expected")
    E, V = cfg.hidden, cfg.vocab
    for name, shape in ((names.EMBED, (V, E)), (names.LM_HEAD, (V, E)), (names.NORM, (E,)),
                        (names.OUT_RES_NORM, (E,)), (names.OUT_RES_PROJ, (1, E))):
        t = _info(index, name)
        if t is None:
            continue
        if t.shape != shape:
            raise CheckpointError(f"{name} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{name} has dtype {t.dtype}, expected bf16, f16 or f32")


def _info(index: CheckpointIndex, name: str) -> TensorInfo | None:
    return index.tensors.get(name)
