"""Load the ``tiny-flat`` fixture (released tensor names, bf16 trunk, MXFP4 experts) for tests.

A deliberately small safetensors parser (header length, JSON header, raw little-endian
data) so the test suites do not depend on the engine's checkpoint reader: the arrays come
back exactly as stored (bf16 as ``uint16`` bit patterns, MXFP4 as ``uint8``), read-only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from k3core.model.config import ModelConfig
from k3core.testing.oracle import NamedArrays

_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "U8": np.dtype("u1"),
    "I32": np.dtype("<i4"),
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file, as read-only arrays."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        out[name] = np.frombuffer(raw, dtype=dtype, count=(end - start) // dtype.itemsize,
                                  offset=base + start).reshape(info["shape"])
    return out


def load_tiny_flat(fixtures: Path) -> tuple[ModelConfig, NamedArrays, dict[str, Any]]:
    """The tiny-flat model's config, weights and reference (``ref_logits.json``)."""
    root = fixtures / "tiny-flat"
    cfg = ModelConfig.from_json_dict(
        json.loads((root / "config.json").read_text()), source="tiny-flat/config.json"
    )
    ref = json.loads((root / "ref_logits.json").read_text())
    return cfg, NamedArrays(read_safetensors(root / "model.safetensors")), ref
