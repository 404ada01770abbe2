"""``k3 synth --sparse``: the released shapes and headers, the data as holes.

Every shard is a real safetensors file (an 8-byte length, the JSON header, the data
section) with the released names, shapes and dtypes (bf16 matrices and norm gains, f32
conv kernels, ``A_log``, ``dt_bias``, ``o_norm`` and router bias, MXFP4 experts as U8
packed nibbles plus E8M0 scales), but the data section is made with ``ftruncate`` and only
a small deterministic pattern is written into it, so a 1.56 TB checkpoint takes tens of MB
of disk. The pattern (:func:`patches`) keeps the forward pass alive and finite:

* the hidden state lives in the first :data:`ACTIVE` channels: the embedding and
  ``lm_head`` rows of the first :data:`TABLE_ROWS` ids are nonzero there (run it with
  ``--ids`` below 256; every other row is zero, so the argmax stays in those ids or the first zero row);
* every matrix has a :data:`ROWS` x :data:`ACTIVE` block in its corner (``kv_b_proj`` a
  second one at the first value rows), scaled ``1/sqrt(fan-in)`` as the dense writer does;
* norm gains are 1, ``A_log`` is the dense writer's spread, conv kernels are nonzero in the
  live channels, the router bias is a permuted spread of +-0.05;
* the router gate has :data:`ROUTER_ROWS` live experts per layer, chosen per layer from the
  seed, and :data:`LIVE_EXPERTS` of them carry a nonzero MXFP4 corner, so the selection
  differs across layers and tokens and some routed experts add to the sum.

Everything else is zero: E8M0 scale 0 times code 0 is 0, RMSNorm of a zero vector is zero,
and no value becomes NaN or inf. :func:`check_keeps_holes` refuses a filesystem that would
store the holes as data (it would fill the disk) before anything large is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3core.api.errors import OutputError
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import expected_shapes, trunk_suffixes
from k3core.model.sizes import planned_tensor_bytes

#: live hidden channels (and the columns of every matrix block)
ACTIVE = 4
#: rows of every matrix block
ROWS = 4
#: embedding / lm_head rows that are nonzero (the byte tokens of the fitted tokenizer)
TABLE_ROWS = 256
#: router rows with a nonzero corner per MoE layer
ROUTER_ROWS = 16
#: routed experts per MoE layer with a nonzero MXFP4 corner (among the live router rows)
LIVE_EXPERTS = 4
#: rows of an expert matrix's nonzero corner
EXPERT_ROWS = 2
#: the released vision tower's census: 168 tensors, 894,717,952 bytes, alone in two shards
VISION_TENSORS = 168
VISION_BYTES = 894_717_952

_ITEM = {"BF16": 2, "F32": 4, "U8": 1}
_PROBE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class SparseTensor:
    """One tensor of a sparse shard: its header entry and the bytes that are not zero."""

    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    patches: tuple[tuple[int, bytes], ...]  # (offset inside the tensor, bytes)

    @property
    def nbytes(self) -> int:
        n = _ITEM[self.dtype]
        for s in self.shape:
            n *= s
        return n


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), 0x5EA5E])


def _bf16(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def _corner(shape: tuple[int, ...], rows: list[int], values: np.ndarray, item: int,
            col0: int = 0) -> list[tuple[int, bytes]]:
    """Patches writing ``values[i]`` at row ``rows[i]``, columns from ``col0``."""
    cols = shape[-1] if len(shape) > 1 else shape[0]
    out = []
    for i, r in enumerate(rows):
        out.append(((r * cols + col0) * item, np.ascontiguousarray(values[i]).tobytes()))
    return out


def _matrix(seed: int, name: str, shape: tuple[int, ...], rows: list[int] | None = None,
            scale: float | None = None) -> list[tuple[int, bytes]]:
    R, C = shape[0], int(np.prod(shape[1:]))
    rows = list(range(min(ROWS, R))) if rows is None else rows
    c = min(ACTIVE, C)
    std = np.float32(scale if scale is not None else 1.0 / np.sqrt(C))
    v = _rng(seed, name).standard_normal((len(rows), c), dtype=np.float32) * std
    return _corner((R, C), rows, _bf16(v), 2)


def _vector_f32(values: np.ndarray) -> list[tuple[int, bytes]]:
    return [(0, np.ascontiguousarray(values, dtype="<f4").tobytes())]


def live_router_rows(cfg: ModelConfig, seed: int, layer: int) -> list[int]:
    """The experts whose router rows are nonzero in ``layer`` (sorted)."""
    r = _rng(seed, f"router-rows.{layer}")
    k = min(ROUTER_ROWS, cfg.n_experts)
    return sorted(int(e) for e in r.choice(cfg.n_experts, size=k, replace=False))


def live_experts(cfg: ModelConfig, seed: int, layer: int) -> list[int]:
    """The routed experts of ``layer`` that carry a nonzero MXFP4 corner."""
    return live_router_rows(cfg, seed, layer)[: LIVE_EXPERTS]


def _dtype_of(suffix: str, shape: tuple[int, ...]) -> str:
    return "F32" if planned_tensor_bytes(suffix, shape) == 4 * int(np.prod(shape)) else "BF16"


def patches(cfg: ModelConfig, seed: int, layer: int, suffix: str, shape: tuple[int, ...],
            dtype: str) -> list[tuple[int, bytes]]:
    """The nonzero bytes of one trunk tensor (see the module docstring)."""
    name = names.layer_name(layer, suffix)
    n = int(np.prod(shape))
    if suffix == "self_attn.A_log":
        out = np.zeros(shape, dtype=np.float32)
        out[: cfg.kda_heads] = np.linspace(-0.4, 1.2, cfg.kda_heads, dtype=np.float32)
        return _vector_f32(out)
    if suffix == "self_attn.dt_bias":
        return []
    if suffix == "block_sparse_moe.gate.e_score_correction_bias":
        r = _rng(seed, name)
        return _vector_f32(np.linspace(-0.05, 0.05, n, dtype=np.float32)[r.permutation(n)])
    if suffix.endswith("conv1d.weight"):  # [P, 1, K]: the live channels, every tap
        K = shape[-1]
        v = _rng(seed, name).standard_normal((min(ACTIVE, shape[0]), K), dtype=np.float32)
        return [(0, (v * np.float32(0.4)).astype("<f4").tobytes())]
    if suffix.endswith("_res_proj.weight"):  # [1, E]: the AttnRes scoring vectors
        v = _rng(seed, name).standard_normal(min(ACTIVE, n), dtype=np.float32) * np.float32(0.1)
        return [(0, _bf16(v).tobytes() if dtype == "BF16" else v.astype("<f4").tobytes())]
    if len(shape) == 1:  # norm gains: 1
        ones = np.ones(n, dtype=np.float32)
        return [(0, _bf16(ones).tobytes() if dtype == "BF16" else ones.astype("<f4").tobytes())]
    if suffix == "block_sparse_moe.gate.weight":
        return _matrix(seed, name, shape, rows=live_router_rows(cfg, seed, layer))
    if suffix == "self_attn.kv_b_proj.weight":  # per head [k_nope | v]: both halves of head 0
        half = cfg.qk_nope
        rows = sorted(set(range(min(ROWS, shape[0]))) | set(range(half, min(half + ROWS, shape[0]))))
        return _matrix(seed, name, shape, rows=rows)
    return _matrix(seed, name, shape)


def _expert_part(seed: int, name: str, rows: int, cols: int) -> tuple[SparseTensor, SparseTensor]:
    pn, sn = f"{name}_packed", f"{name}_scale"
    r = _rng(seed, pn)
    k = min(EXPERT_ROWS, rows)
    packed = r.integers(0, 256, size=(k, min(ACTIVE, cols) // 2 or 1), dtype=np.uint8)
    base = 127 - int(round(np.log2(2.6 * np.sqrt(cols))))
    scales = np.full((k, 1), base, dtype=np.uint8)
    return (SparseTensor(pn, "U8", (rows, cols // 2), tuple(_corner((rows, cols // 2), list(range(k)), packed, 1))),
            SparseTensor(sn, "U8", (rows, cols // 32), tuple(_corner((rows, cols // 32), list(range(k)), scales, 1))))


def layer_tensors(cfg: ModelConfig, seed: int, layer: int) -> list[SparseTensor]:
    """Layer ``layer``'s tensors in file order: the trunk run, then each expert's six."""
    shapes = expected_shapes(cfg, layer)
    trunk = []
    for suffix in trunk_suffixes(cfg, layer):
        shape = shapes.get(suffix) or (max(cfg.kda_heads, cfg.kda_head_dim),)
        dtype = _dtype_of(suffix, shape)
        trunk.append(SparseTensor(names.layer_name(layer, suffix), dtype, shape,
                                  tuple(patches(cfg, seed, layer, suffix, shape, dtype))))
    trunk.sort(key=lambda t: (-_ITEM[t.dtype], t.name))
    out = trunk
    if cfg.is_dense(layer):
        return out
    live = set(live_experts(cfg, seed, layer))
    dims = {"w1": (cfg.moe_inter, cfg.latent), "w2": (cfg.latent, cfg.moe_inter),
            "w3": (cfg.moe_inter, cfg.latent)}
    for e in range(cfg.n_experts):
        for part in names.EXPERT_PARTS:
            rows, cols = dims[part]
            base = names.expert_name(layer, e, part, "weight")
            if e in live:
                out.extend(_expert_part(seed, base, rows, cols))
            else:
                out.append(SparseTensor(f"{base}_packed", "U8", (rows, cols // 2), ()))
                out.append(SparseTensor(f"{base}_scale", "U8", (rows, cols // 32), ()))
    return out


def table_tensors(cfg: ModelConfig, seed: int) -> list[SparseTensor]:
    """The embedding, the head and the three model-level vectors (all bf16, as released)."""
    E, V = cfg.hidden, cfg.vocab
    rows = list(range(min(TABLE_ROWS, V)))
    ones = tuple([(0, _bf16(np.ones(E, dtype=np.float32)).tobytes())])
    proj = _rng(seed, names.OUT_RES_PROJ).standard_normal(min(ACTIVE, E), dtype=np.float32)
    return [
        SparseTensor(names.EMBED, "BF16", (V, E), tuple(_matrix(seed, names.EMBED, (V, E), rows, 1.0))),
        SparseTensor(names.LM_HEAD, "BF16", (V, E), tuple(_matrix(seed, names.LM_HEAD, (V, E), rows))),
        SparseTensor(names.NORM, "BF16", (E,), ones),
        SparseTensor(names.OUT_RES_NORM, "BF16", (E,), ones),
        SparseTensor(names.OUT_RES_PROJ, "BF16", (1, E), ((0, _bf16(proj * np.float32(0.1)).tobytes()),)),
    ]


def vision_shards() -> list[list[SparseTensor]]:
    """Stand-ins for the vision tower's two shards: the released tensor count and bytes,
    all zero, under ``vision_tower.k3_synth.N.weight`` (the text model never reads them)."""
    elems = VISION_BYTES // 2
    each, extra = divmod(elems, VISION_TENSORS)
    tensors = [SparseTensor(f"vision_tower.k3_synth.{i:03d}.weight", "BF16",
                            (each + (1 if i < extra else 0),), ())
               for i in range(VISION_TENSORS)]
    half = VISION_TENSORS // 2
    return [tensors[:half], tensors[half:]]


def write_sparse_shard(path: Path, tensors: list[SparseTensor]) -> int:
    """Write one shard: the header, a data section of holes, the patches; returns its data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data0 = 8 + len(raw)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
    try:
        os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
        os.ftruncate(fd, data0 + pos)
        begin = 0
        for t in tensors:
            for off, data in t.patches:
                if off + len(data) > t.nbytes:
                    raise ValueError(f"{t.name}: pattern runs past the tensor")
                os.pwrite(fd, data, data0 + begin + off)
            begin += t.nbytes
    finally:
        os.close(fd)
    return pos


def allocated_bytes(path: Path) -> int:
    """Bytes the filesystem stores for ``path`` (``st_blocks`` is in 512-byte units)."""
    return os.stat(path).st_blocks * 512


def check_keeps_holes(directory: Path) -> None:
    """Refuse (exit 3) when a file truncated to 16 MiB with one byte written takes more than
    a quarter of that on disk: that filesystem would store a sparse checkpoint as data."""
    probe = directory / f".k3-hole-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _PROBE_BYTES)
            os.pwrite(fd, b"\1", _PROBE_BYTES // 2)
            os.fsync(fd)
        finally:
            os.close(fd)
        used = allocated_bytes(probe)
    except OSError as exc:
        raise OutputError(f"cannot write the synthetic checkpoint to {directory}: "
                          f"{exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    if used > _PROBE_BYTES // 4:
        raise OutputError(f"--sparse: the filesystem of {directory} does not keep holes (a "
                          f"16 MiB probe with one byte written takes {used} bytes on disk); "
                          "the sparse checkpoint would be written out in full; choose a "
                          "directory on a filesystem that keeps sparse files (ext4, xfs, "
                          "btrfs, tmpfs)")
