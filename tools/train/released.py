"""Load a checkpoint in the released layout into :class:`tools.train.k3torch.K3`, and write one.

Reading goes through k3's own checkpoint index (bf16 arrives as ``uint16`` bit patterns and
widens exactly; MXFP4 experts decode with the reference kernels' table), so the torch model
holds exactly the numbers k3 computes with. Writing reuses k3 synth's shard writer and
layout: layer ``L`` in shard ``L + 1`` (trunk tensors first, then each expert's six tensors),
the model tables in the last shard, ``model.safetensors.index.json``, the nested
``config.json``; trunk matrices bf16, small vectors float32, ``A_log`` padded with zeros to
``max(heads, head_dim)``, routed experts MXFP4.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from k3_backends.exact_numpy import mxfp4_to_f64

from k3core.checkpoint.index import CheckpointIndex
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.layer_params import expected_shapes
from k3core.plugins.registry import get_registry
from k3core.tools.synth.writer import to_bf16, write_shard
from tools.train.k3torch import K3, mxfp4_codes

PARTS = ("w1", "w2", "w3")


def _f32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _model_name(dotted: str) -> str:
    """torch name (``layers.3.x`` / ``norm.weight``) -> released name."""
    if dotted == "lm_head.weight":
        return names.LM_HEAD
    return names.PREFIX + dotted


def load_model(model_dir: str | Path) -> K3:
    """A fp32 torch model holding exactly the weights of ``model_dir``."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    storage, _, _ = get_registry().create("storage", "plain")
    index = CheckpointIndex.open(model_dir, storage)
    model = K3(cfg)
    try:
        with torch.no_grad():
            for dotted, t in model.named_tensors().items():
                if ".experts." in dotted:
                    L = int(dotted.split(".")[1])
                    part = dotted.rsplit(".", 1)[1]
                    for e in range(cfg.n_experts):
                        t[e] = torch.from_numpy(_expert(index, L, e, part))
                    continue
                a = _f32(index.read(_model_name(dotted)))
                if dotted.endswith("A_log"):
                    a = a[: cfg.kda_heads]
                t.copy_(torch.from_numpy(np.ascontiguousarray(a)).reshape(t.shape))
    finally:
        index.close()
    return model


def _expert(index: CheckpointIndex, L: int, e: int, part: str) -> np.ndarray:
    packed = names.expert_name(L, e, part, "weight_packed")
    if packed in index:
        p = index.read(packed)
        s = index.read(names.expert_name(L, e, part, "weight_scale"))
        return mxfp4_to_f64(p, s).astype(np.float32)
    return _f32(index.read(names.expert_name(L, e, part, "weight")))


def pack_mxfp4(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``[rows, cols]`` float -> (packed U8 ``[rows, cols/2]``, E8M0 scales ``[rows, cols/32]``)."""
    codes, exps = mxfp4_codes(w)
    c = codes.numpy().astype(np.uint8)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
    scales = (exps.numpy() + 127).astype(np.int64)
    assert scales.min() >= 0 and scales.max() <= 254
    return packed, scales.astype(np.uint8)


def _small(suffix: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 1 or suffix.endswith(("_res_proj.weight", "conv1d.weight"))


def export(model: K3, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` in the released layout to ``out_dir`` (replaced atomically)."""
    cfg: ModelConfig = model.cfg
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t = {k: v.detach().float().cpu() for k, v in model.named_tensors().items()}
    n_shards = cfg.n_layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        if i < cfg.n_layers:
            L = i
            for suffix, shape in expected_shapes(cfg, L).items():
                a = t[f"layers.{L}.{suffix}"].reshape(shape).numpy()
                tensors[names.layer_name(L, suffix)] = (
                    a.astype(np.float32) if _small(suffix, shape) else to_bf16(a))
            if not cfg.is_mla(L):
                H, D = cfg.kda_heads, cfg.kda_head_dim
                a_log = np.zeros(max(H, D), dtype=np.float32)
                a_log[:H] = t[f"layers.{L}.self_attn.A_log"].numpy()
                tensors[names.layer_name(L, "self_attn.A_log")] = a_log
            if not cfg.is_dense(L):
                for e in range(cfg.n_experts):
                    for part in PARTS:
                        w = t[f"layers.{L}.block_sparse_moe.experts.{part}"][e]
                        p, s = pack_mxfp4(w)
                        tensors[names.expert_name(L, e, part, "weight_packed")] = p
                        tensors[names.expert_name(L, e, part, "weight_scale")] = s
        else:
            tensors = {
                names.EMBED: to_bf16(t["embed_tokens.weight"].numpy()),
                names.LM_HEAD: to_bf16(t["lm_head.weight"].numpy()),
                names.NORM: t["norm.weight"].numpy().astype(np.float32),
                names.OUT_RES_NORM: t["output_attn_res_norm.weight"].numpy().astype(np.float32),
                names.OUT_RES_PROJ: t["output_attn_res_proj.weight"].numpy().astype(np.float32),
            }
        total += write_shard(tmp / shard, tensors)
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    conf = cfg.to_nested_dict()
    if extra:
        conf.update(extra)
    (tmp / "config.json").write_text(json.dumps(conf, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out
