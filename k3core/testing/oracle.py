"""Adapter for the 13-layer PyTorch oracle (``fixtures/oracle``) and the op fixtures.

The oracle's weights are a flat little-endian float32 blob plus a map from underscore-joined
names to ``{offset (floats), shape}``; its routed experts are dense float32. This adapter
presents them under the released tensor names so the ordinary model graph runs them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from k3core.model import names
from k3core.model.config import ModelConfig


def fixture_array(entry: dict[str, Any]) -> np.ndarray:
    """``{"shape": [...], "data": [...]}`` -> float32 array."""
    return np.asarray(entry["data"], dtype=np.float32).reshape(entry["shape"])


class NamedArrays:
    """A tensor reader over an in-memory ``{released name: array}`` map."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def read(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def released_name(oracle_name: str) -> str:
    """Map an oracle tensor name (``layers_3_self_attn_q_a_proj_weight``) to the released one."""
    if oracle_name in names.ORACLE_MODEL:
        return names.ORACLE_MODEL[oracle_name]
    _, layer, short = oracle_name.split("_", 2)
    return names.layer_name(int(layer), names.oracle_suffix(short))


def load_oracle(fixtures: Path) -> tuple[ModelConfig, NamedArrays, dict[str, Any]]:
    """The oracle's config, weights (released names) and reference (``ref_k3.json``)."""
    ref = json.loads((fixtures / "oracle" / "ref_k3.json").read_text())
    meta = json.loads((fixtures / "oracle" / "tiny_k3.json").read_text())
    blob = np.fromfile(fixtures / "oracle" / "tiny_k3.bin", dtype="<f4")
    tensors = {}
    for name, info in meta["tensors"].items():
        n = int(np.prod(info["shape"])) if info["shape"] else 1
        a = blob[info["offset"] : info["offset"] + n].reshape(info["shape"])
        tensors[released_name(name)] = np.ascontiguousarray(a, dtype=np.float32)
    cfg = ModelConfig.from_json_dict(ref["config"], source="oracle/ref_k3.json")
    return cfg, NamedArrays(tensors), ref


def layer_fixture_raw(fx: dict[str, Any], layer: int) -> dict[str, np.ndarray]:
    """The weights of a ``layer_kda``/``layer_mla`` op fixture as ``{suffix: array}``."""
    raw = {}
    for key, val in fx.items():
        if isinstance(val, dict) and "shape" in val and key not in (
            "in",
            "out",
            "block_residual_in",
            "block_residual_out",
        ):
            raw[names.oracle_suffix(key)] = fixture_array(val)
    return raw
