"""``k3 synth``: a deterministic synthetic checkpoint in the released layout.

The weights are random (seeded), so the text it produces is meaningless; the layout is
the real one: sharded safetensors with ``model.safetensors.index.json``, a nested
``config.json`` (with ``kda_layers``), bf16 trunk matrices, float32 small tensors, MXFP4
experts with sane scales, ``A_log`` padded to ``head_dim``, and a tokenizer (``tiktoken.model`` and
``tokenizer_config.json``) fitted to the vocabulary. Layer ``L`` lives in shard
``L + 1`` with its trunk tensors first (one contiguous run) and each expert's six tensors
contiguous after them, as in the released checkpoint; the model tables take the last shard.
Everything is written under a partial name (``.OUT.partial-PID``, :mod:`k3core.api.partials`:
removed on any exit the process can catch, and by the next synth if it was killed) and
renamed into place only when complete.
``sparse=True`` writes the same layout with the released dtypes and the data as holes
(:mod:`k3core.tools.synth.sparse`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, TensorSpec, serialize_file

from k3core.api.errors import OutputError, UsageError
from k3core.api.outputs import Output, check_outputs
from k3core.api.partials import whole_tree
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import expected_shapes
from k3core.tokenizer.fit import write_tokenizer
from k3core.tools.synth.sparse import check_keeps_holes, vision_shards, write_sparse_shard
from k3core.tools.synth.sparse import layer_tensors as sparse_layer
from k3core.tools.synth.sparse import table_tensors as sparse_tables

_ST_DTYPE = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float32): "float32", np.dtype(np.uint8): "uint8"}


_UMASK = os.umask(0)
os.umask(_UMASK)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


class _Gen:
    """Draws every tensor from its own seeded stream, so the order of writing never matters."""

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg = cfg
        self.seed = seed

    def matrix(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        std = 1.0 / np.sqrt(shape[-1])
        return to_bf16(_rng(self.seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std))

    def vector(self, name: str, shape: tuple[int, ...], suffix: str) -> np.ndarray:
        r = _rng(self.seed, name)
        c = self.cfg
        if suffix.endswith("conv1d.weight"):
            return (r.standard_normal(shape, dtype=np.float32) * np.float32(0.4)).astype(np.float32)
        if suffix == "self_attn.dt_bias":
            return (r.standard_normal(shape, dtype=np.float32) * np.float32(0.5)).astype(np.float32)
        if suffix == "block_sparse_moe.gate.e_score_correction_bias":
            return np.linspace(-0.05, 0.05, shape[0], dtype=np.float32)[r.permutation(shape[0])]
        if suffix.endswith("_res_proj.weight"):
            return (r.standard_normal(shape, dtype=np.float32) * np.float32(0.1)).astype(np.float32)
        gain = 1.0 + 0.05 * r.standard_normal(shape, dtype=np.float32)
        del c
        return gain.astype(np.float32)

    def a_log(self, name: str) -> np.ndarray:
        c = self.cfg
        out = np.zeros(max(c.kda_heads, c.kda_head_dim), dtype=np.float32)
        out[: c.kda_heads] = np.linspace(-0.4, 1.2, c.kda_heads, dtype=np.float32)
        return out

    def mxfp4(self, name: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
        r = _rng(self.seed, name)
        packed = r.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
        # E2M1 codes average |v| ~ 2.6; aim each row's product at ~1/sqrt(cols) per input
        base = 127 - int(round(np.log2(2.6 * np.sqrt(cols))))
        scales = (base + r.integers(-1, 2, size=(rows, cols // 32))).astype(np.uint8)
        return packed, scales


def layer_tensors(g: _Gen, layer: int) -> dict[str, np.ndarray]:
    """All tensors of one layer (trunk and routed experts) under their released names."""
    c = g.cfg
    out: dict[str, np.ndarray] = {}
    for suffix, shape in expected_shapes(c, layer).items():
        name = names.layer_name(layer, suffix)
        small = len(shape) == 1 or suffix.endswith(("_res_proj.weight", "conv1d.weight"))
        out[name] = g.vector(name, shape, suffix) if small else g.matrix(name, shape)
    if not c.is_mla(layer):
        name = names.layer_name(layer, "self_attn.A_log")
        out[name] = g.a_log(name)
    if not c.is_dense(layer):
        dims = {"w1": (c.moe_inter, c.latent), "w3": (c.moe_inter, c.latent), "w2": (c.latent, c.moe_inter)}
        for e in range(c.n_experts):
            for part, (rows, cols) in dims.items():
                pn = names.expert_name(layer, e, part, "weight_packed")
                out[pn], out[names.expert_name(layer, e, part, "weight_scale")] = g.mxfp4(pn, rows, cols)
    return out


def table_tensors(g: _Gen) -> dict[str, np.ndarray]:
    c = g.cfg
    E, V = c.hidden, c.vocab
    return {
        names.EMBED: g.matrix(names.EMBED, (V, E)),
        names.LM_HEAD: g.matrix(names.LM_HEAD, (V, E)),
        names.NORM: g.vector(names.NORM, (E,), "norm.weight"),
        names.OUT_RES_NORM: g.vector(names.OUT_RES_NORM, (E,), "norm.weight"),
        names.OUT_RES_PROJ: g.vector(names.OUT_RES_PROJ, (1, E), "_res_proj.weight"),
    }


def write_shard(path: Path, tensors: dict[str, np.ndarray]) -> int:
    """Write one shard with the ``safetensors`` package; returns its data bytes."""
    specs = {}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        tensors[name] = a
        specs[name] = TensorSpec(
            dtype=_ST_DTYPE[a.dtype], shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
    try:
        serialize_file(specs, str(path), {"format": "pt"})
    except SafetensorError as exc:  # the writer's I/O errors (a full disk) arrive as this
        raise OSError(errno.EIO, f"{path.name}: {exc}") from None
    os.chmod(path, 0o666 & ~_UMASK)
    return sum(a.nbytes for a in tensors.values())


def synthesize(
    out_dir: str | Path,
    cfg: ModelConfig,
    seed: int = 0,
    *,
    force: bool = False,
    progress: Callable[[int, int, int], None] | None = None,
    extra: Callable[[Path], None] | None = None,
    sparse: bool = False,
    vision: bool = False,
) -> Path:
    """Write the checkpoint to ``out_dir`` atomically; ``progress(done, total, nbytes)`` per
    shard (shards written, shards in all, the bytes of tensor data written so far).

    ``sparse`` writes the released dtypes with the data as holes plus a small pattern
    (:mod:`k3core.tools.synth.sparse`); ``vision`` adds the two stand-in vision shards the
    released checkpoint ends with (sparse only).
    """
    out = Path(out_dir)
    check_outputs([Output(out, "the synthetic checkpoint", directory=True, create=False)])
    if out.exists() and any(out.iterdir()):
        if not force:
            raise UsageError(f"{out} exists and is not empty; pass --force to replace it")
        if not _is_synthetic(out):
            raise OutputError(f"cannot write the synthetic checkpoint to {out}: it holds files "
                              "that k3 synth did not write, and --force replaces only a "
                              "checkpoint k3 synth wrote; remove it yourself or pick another "
                              "directory")
    if vision and not sparse:
        raise UsageError("the vision stand-in shards are written only with --sparse")
    # replace: out is absent, empty, or a checkpoint k3 synth wrote (checked above)
    with whole_tree(out, f"cannot write the synthetic checkpoint to {out}", replace=True) as tmp:
        _write_all(tmp, cfg, seed, sparse, vision, progress, extra)
    return out


def _is_synthetic(out: Path) -> bool:
    """True for a directory k3 synth wrote: its config is marked and it holds nothing else."""
    try:
        conf = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(conf, dict) or "k3_synthetic" not in conf:
        return False
    own = re.compile(r"(model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json|"
                     r"config\.json|tiktoken\.model|tokenizer_config\.json)")
    return all(p.is_file() and not p.is_symlink() and own.fullmatch(p.name)
               for p in out.iterdir())


def _write_all(tmp: Path, cfg: ModelConfig, seed: int, sparse: bool, vision: bool,
               progress: Callable[[int, int, int], None] | None,
               extra: Callable[[Path], None] | None) -> None:
    """Every file of the checkpoint into the (partial) directory ``tmp``."""
    if sparse:
        check_keeps_holes(tmp)
    g = _Gen(cfg, seed)
    n_shards = cfg.n_layers + 1 + (2 if vision else 0)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        if sparse:
            sp = (sparse_layer(cfg, seed, i) if i < cfg.n_layers else
                  sparse_tables(cfg, seed) if i == cfg.n_layers else
                  vision_shards()[i - cfg.n_layers - 1])
            total += write_sparse_shard(tmp / shard, sp)
            os.chmod(tmp / shard, 0o666 & ~_UMASK)
            weight_map.update(dict.fromkeys((t.name for t in sp), shard))
        else:
            tensors = layer_tensors(g, i) if i < cfg.n_layers else table_tensors(g)
            total += write_shard(tmp / shard, tensors)
            weight_map.update(dict.fromkeys(tensors, shard))
        if progress:
            progress(i + 1, n_shards, total)
    index = {"metadata": {"total_size": total, "k3_synth_seed": seed}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    conf = cfg.to_nested_dict()
    conf["k3_synthetic"] = {"seed": seed, "note": "random weights written by k3 synth"}
    if sparse:
        conf["k3_synthetic"]["sparse"] = True
    (tmp / "config.json").write_text(json.dumps(conf, indent=1))
    if cfg.vocab >= 256:
        write_tokenizer(tmp, cfg.vocab, seed=seed)
    if extra:
        extra(tmp)
