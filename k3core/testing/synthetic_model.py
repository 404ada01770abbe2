"""Small models generated in memory for the kernel suite's whole-model tests (no files).

Two variants of the 13-layer ``tiny`` shape (the reference oracle's: KDA and MLA layers, two
AttnRes blocks complete and a third in progress), drawn from ``k3 synth``'s seeded streams:

* ``released``: the released tensor layout, bf16 trunk matrices and MXFP4 routed experts;
* ``float32``: every matrix float32 with full 24-bit mantissas and dense float32 experts,
  so ``matmul_f32`` carries the whole model.

The reference logits come from running the numpy backend on the same weights, so nothing
but k3 itself is needed: the suite runs from a wheel, outside any checkout.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.testing.oracle import NamedArrays
from k3core.tools.synth.writer import _Gen, _rng, layer_tensors, table_tensors

MODELS = ("float32", "released")
PROMPT = [3, 7, 11, 5, 9, 2, 14]
_OVERRIDES = {"vocab_size": 256, "intermediate_size": 96}
_SEED = 17


def _dense(name: str, shape: tuple[int, ...]) -> np.ndarray:
    std = np.float32(1.0 / np.sqrt(shape[-1]))
    return (_rng(_SEED, name).standard_normal(shape, dtype=np.float32) * std).astype(np.float32)


@functools.lru_cache(maxsize=2)
def synthetic_model(which: str) -> tuple[ModelConfig, NamedArrays, dict[str, Any]]:
    """``(config, tensors by released name, {"prompt_ids": ...})`` of one variant."""
    if which not in MODELS:
        raise ValueError(f"unknown synthetic model {which!r}; choose from {MODELS}")
    cfg = ModelConfig.from_json_dict(size_config("tiny", _OVERRIDES), source=f"synthetic {which}")
    g = _Gen(cfg, _SEED)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(cfg.n_layers):
        tensors.update(layer_tensors(g, layer))
    tensors.update(table_tensors(g))
    if which == "float32":
        for name in list(tensors):
            a = tensors.get(name)
            if a is None:  # a scale already folded into its dense expert matrix
                continue
            if a.dtype == np.uint16:  # a bf16 matrix
                tensors[name] = _dense(name, a.shape)
            elif name.endswith(".weight_packed"):
                base = name[: -len(".weight_packed")]
                del tensors[name], tensors[base + ".weight_scale"]
                rows, cols = a.shape[0], a.shape[1] * 2
                tensors[base + ".weight"] = _dense(base, (rows, cols))
    for a in tensors.values():
        a.setflags(write=False)
    return cfg, NamedArrays(tensors), {"prompt_ids": list(PROMPT)}
