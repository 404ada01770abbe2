"""Where each routed expert's bytes are: located once from the checkpoint index.

An expert is three matrices (``w1`` gate, ``w3`` up, ``w2`` down), each MXFP4 (packed bytes
plus E8M0 scales: six tensors) or, in the oracle, dense. In the released checkpoint the six
tensors of an expert are one contiguous run (w1, w2, w3; packed then scale), read with one
call; when they are not, each tensor is read on its own into its place in the slot. Either
way the slot holds the tensors at the offsets this layout records.

A slot's layout (each tensor's place, size, shape and dtype in the slot) is the same for
every expert of a checkpoint in practice: it is checked once per distinct layout, and views
over a checked layout are built without checking it again (a miss pays for the views it
needs, not for validation it already passed).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from k3core.api.errors import CheckpointError
from k3core.api.experts import ExpertWeights
from k3core.api.kernels import Mxfp4
from k3core.checkpoint.index import CheckpointIndex, TensorInfo
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.sources import checked_mxfp4

_FIELDS = ("weight_packed", "weight_scale")

#: a slot layout: ``(key, slot_off, nbytes, shape, dtype)`` per tensor
Layout = tuple[tuple[str, int, int, tuple[int, ...], np.dtype], ...]
#: where one tensor of a checked layout sits: ``(slot_off, nbytes, dtype, shape)``
_Where = tuple[int, int, np.dtype, tuple[int, ...]]
#: how one matrix is built from a checked layout: MXFP4 ``(packed, scales)`` or ``(dense,)``
_Plan = tuple[_Where, ...]


@dataclass(frozen=True)
class Part:
    """One tensor of an expert: where it sits in the slot and where it comes from."""

    key: str  # e.g. "w1.weight_packed"
    slot_off: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: np.dtype
    file_off: int
    path: Path  # the shard holding this tensor (an expert may straddle two shards)


@dataclass(frozen=True)
class ExpertRef:
    layer: int
    expert: int
    path: Path
    offset: int  # start of the run (contiguous) or of the first part
    nbytes: int  # bytes the slot needs
    contiguous: bool
    parts: tuple[Part, ...]
    #: the slot layout the views are built from: ``(key, slot_off, nbytes, shape, dtype)``
    #: per part; experts with equal layouts share one check (``ExpertLocator._check``)
    layout: Layout = ()


class ExpertLocator:
    """``(layer, expert) -> ExpertRef``, built lazily per layer and checked against the config."""

    def __init__(self, cfg: ModelConfig, index: CheckpointIndex):
        self.cfg = cfg
        self.index = index
        self._refs: dict[tuple[int, int], ExpertRef] = {}
        lat, inter = cfg.latent, cfg.moe_inter
        self.logical = {"w1": (inter, lat), "w3": (inter, lat), "w2": (lat, inter)}
        self._zeros = np.zeros(0, dtype=np.uint8)  # _check's read-only stand-in for a slot
        # layouts whose views passed the check, each with the parts that make each matrix
        self._plans: dict[Layout, tuple[_Plan, ...]] = {}

    def ref(self, layer: int, expert: int) -> ExpertRef:
        key = (layer, expert)
        r = self._refs.get(key)
        if r is None:
            r = self._locate(layer, expert)
            self._refs[key] = r
        return r

    def max_bytes(self, layers: range) -> int:
        """Slot size: the largest expert over ``layers`` (checks every MoE layer's first
        expert the checkpoint holds: expert 0, or in an expert share (``k3 shard-experts``)
        the first one that share owns)."""
        sizes = [self.ref(L, self._first_held(L)).nbytes for L in layers if not self.cfg.is_dense(L)]
        return max(sizes) if sizes else 0

    def _first_held(self, layer: int) -> int:
        """The lowest expert id of ``layer`` with tensors in the index (0 when none has:
        its lookup then names the missing tensor)."""
        for e in range(self.cfg.n_experts):
            base = names.expert_name(layer, e, names.EXPERT_PARTS[0], "")
            if f"{base}weight_packed" in self.index or f"{base}weight" in self.index:
                return e
        return 0

    def _infos(self, layer: int, expert: int) -> list[tuple[str, TensorInfo]]:
        out = []
        base = names.expert_name(layer, expert, "", "")[:-1]  # "...experts.{expert}."
        for part in names.EXPERT_PARTS:
            packed = f"{base}{part}.weight_packed"
            if packed in self.index:
                for f in _FIELDS:
                    out.append((f"{part}.{f}", self.index.info(f"{base}{part}.{f}")))
            else:
                dense = f"{base}{part}.weight"
                if dense not in self.index:
                    raise CheckpointError(f"missing routed expert tensor {packed}")
                out.append((f"{part}.weight", self.index.info(dense)))
        return out

    def _locate(self, layer: int, expert: int) -> ExpertRef:
        if not 0 <= expert < self.cfg.n_experts:
            raise CheckpointError(f"expert {expert} outside 0..{self.cfg.n_experts - 1}")
        infos = self._infos(layer, expert)
        paths = {i.path for _, i in infos}
        ordered = sorted(infos, key=lambda kv: (str(kv[1].path), kv[1].offset))
        start = ordered[0][1].offset
        contiguous = len(paths) == 1 and all(
            a.offset + a.nbytes == b.offset for (_, a), (_, b) in pairwise(ordered)
        )
        parts = []
        pos = 0
        for key, info in ordered:
            slot_off = info.offset - start if contiguous else pos
            parts.append(Part(key, slot_off, info.nbytes, info.shape, info.np_dtype, info.offset, info.path))
            pos += info.nbytes
        total = ordered[-1][1].offset + ordered[-1][1].nbytes - start if contiguous else pos
        path = ordered[0][1].path
        layout = tuple((p.key, p.slot_off, p.nbytes, p.shape, p.dtype) for p in parts)
        ref = ExpertRef(layer, expert, path, start, total, contiguous, tuple(parts), layout)
        self._check(ref)
        return ref

    def _check(self, ref: ExpertRef) -> None:
        # sizes from the headers first: a part claiming more than the config's expert can
        # hold is refused before the zero buffer below is allocated
        (rows, cols), n = self.logical["w1"], len(self.logical)
        limit = n * rows * cols * 4  # three dense float32 matrices: the largest legal form
        if ref.nbytes > limit:
            raise CheckpointError(
                f"routed expert {ref.layer}/{ref.expert}: its tensors hold {ref.nbytes} bytes; "
                f"an expert of this config holds at most {limit} (shapes disagree with the "
                "config)")
        if ref.layout in self._plans:
            return  # an expert laid out like one already checked
        # build views over a zero buffer: validates shapes/dtypes once per layout (one
        # buffer for every check, only ever read: a fresh one each time was an mmap and an
        # munmap per expert, 0.07 s of a first 128-id medium prefill)
        zeros = self._zeros
        if zeros.size < ref.nbytes:
            zeros = self._zeros = np.zeros(ref.nbytes, dtype=np.uint8)
        self._checked_views(ref, zeros[: ref.nbytes])
        self._plans[ref.layout] = _plan(ref.layout)

    def views(self, ref: ExpertRef, buf: np.ndarray) -> ExpertWeights:
        """ExpertWeights over ``buf`` (the slot bytes laid out as ``ref`` says), zero-copy."""
        plan = self._plans.get(ref.layout) if ref.layout else None
        if (plan is None or buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < ref.nbytes
                or not buf.flags.c_contiguous):
            return self._checked_views(ref, buf)
        return ExpertWeights(_build(plan[0], buf), _build(plan[1], buf), _build(plan[2], buf))

    def _checked_views(self, ref: ExpertRef, buf: np.ndarray) -> ExpertWeights:
        """``views`` with every shape and dtype checked against the config."""
        arrays = {}
        for p in ref.parts:
            a = buf[p.slot_off : p.slot_off + p.nbytes].view(p.dtype).reshape(p.shape)
            arrays[p.key] = a
        mats: dict[str, Mxfp4 | np.ndarray] = {}
        for part, (rows, cols) in self.logical.items():
            what = names.expert_name(ref.layer, ref.expert, part, "weight_packed")
            if f"{part}.weight_packed" in arrays:
                mats[part] = checked_mxfp4(
                    arrays[f"{part}.weight_packed"], arrays[f"{part}.weight_scale"], rows, cols, what
                )
            else:
                w = arrays[f"{part}.weight"]
                if tuple(w.shape) != (rows, cols) or w.dtype not in (np.float32, np.uint16):
                    raise CheckpointError(f"{what}: dense expert of shape {list(w.shape)} / {w.dtype}")
                mats[part] = w
        return ExpertWeights(mats["w1"], mats["w3"], mats["w2"])


def _plan(layout: Layout) -> tuple[_Plan, ...]:
    """The (w1, w3, w2) builders of a checked layout."""
    at: dict[str, _Where] = {key: (off, n, dt, shape) for key, off, n, shape, dt in layout}
    out: list[_Plan] = []
    for part in ("w1", "w3", "w2"):
        if f"{part}.weight_packed" in at:
            out.append((at[f"{part}.weight_packed"], at[f"{part}.weight_scale"]))
        else:
            out.append((at[f"{part}.weight"],))
    return tuple(out)


def _build(plan: _Plan, buf: np.ndarray) -> Mxfp4 | np.ndarray:
    """One matrix of a checked layout over the slot bytes ``buf`` (contiguous views)."""
    if len(plan) == 2:
        (po, _, pd, ps), (so, _, sd, ss) = plan
        return Mxfp4(np.ndarray(ps, pd, buf, po), np.ndarray(ss, sd, buf, so))
    off, _, dt, shape = plan[0]
    return np.ndarray(shape, dt, buf, off)


@dataclass(frozen=True, kw_only=True)
class PoolShape:
    """The routed-expert pool of a model, as the simulator counts it (MoE layers x
    experts): top-k, the MoE layers, the highest layer index, the experts of a layer and the
    largest expert's bytes."""

    topk: int
    n_layers: int
    max_layer: int
    n_experts: int
    expert_bytes: int


def pool_shape(model_dir: Path) -> PoolShape:
    """The expert pool of the model in ``model_dir``, from its config and its shards' headers
    (read through the ``plain`` storage backend: no tensor is read)."""
    from k3core.api.errors import UsageError
    from k3core.model.config import load_config
    from k3core.plugins.registry import get_registry

    if not model_dir.is_dir():
        raise UsageError(f"{model_dir} is not a directory (a model directory is)")
    cfg = load_config(model_dir)
    moe = [L for L in range(cfg.n_layers) if not cfg.is_dense(L)]
    if not moe:
        raise UsageError(f"{model_dir}: the model has no MoE layers")
    plain, _, _ = get_registry().create("storage", "plain")  # headers only: any backend reads them
    with CheckpointIndex.open(model_dir, plain) as index:
        nbytes = ExpertLocator(cfg, index).max_bytes(range(cfg.n_layers))
    return PoolShape(topk=cfg.topk, n_layers=len(moe), max_layer=cfg.n_layers - 1,
                     n_experts=cfg.n_experts, expert_bytes=nbytes)
