"""Binding a layer part by part: the same checks and conversions as ``prepare_layer``.

A split layer (:mod:`k3core.trunk.parts`) is bound in pieces: its small tensors once, to
resident float32 copies (:func:`bind_small`, with the AttnRes folds and the KDA ``A_log``
and short-conv reshapes), and each part's matrices as zero-copy views into the part's
buffer whenever it is acquired (:func:`bind_matrices`). Both call the conversions
``prepare_layer`` uses (``_vec``, ``_mat``), so the kernels see the same bytes either way.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from k3core.api.errors import CheckpointError
from k3core.model.config import ModelConfig
from k3core.model.layer_params import FLOAT_DTYPES, _mat, _vec, expected_shapes, finish_small


def _check(cfg: ModelConfig, layer: int, suffix: str, a: np.ndarray,
           shapes: dict[str, tuple[int, ...]]) -> None:
    if a.dtype.type not in FLOAT_DTYPES:
        raise CheckpointError(f"layer {layer}: {suffix} has dtype {a.dtype}, expected a float")
    if suffix == "self_attn.A_log":
        return
    shape = shapes.get(suffix)
    if shape is None:
        raise CheckpointError(f"layer {layer}: unexpected trunk tensor {suffix}")
    if tuple(a.shape) != shape and not (
        suffix.endswith("conv1d.weight") and tuple(a.shape) == (shape[0], shape[2])
    ):
        raise CheckpointError(f"layer {layer}: {suffix} has shape {list(a.shape)}, expected "
                              f"{list(shape)}")


def bind_matrices(cfg: ModelConfig, layer: int, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The matrices of one part, as ``prepare_layer`` would bind them (views for bf16)."""
    shapes = expected_shapes(cfg, layer)
    out = {}
    for suffix, a in raw.items():
        _check(cfg, layer, suffix, a, shapes)
        out[suffix] = _mat(a)
    return out


def bind_small(cfg: ModelConfig, layer: int, raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every small tensor of a layer widened to float32, plus ``fold_attn``/``fold_mlp``."""
    shapes = expected_shapes(cfg, layer)
    t: dict[str, np.ndarray] = {}
    for suffix, a in raw.items():
        _check(cfg, layer, suffix, a, shapes)
        if suffix != "self_attn.A_log":
            t[suffix] = _vec(a)
    finish_small(cfg, layer, t, raw.get("self_attn.A_log"))
    return t
