"""Where the trunk and the model tables come from.

The model graph asks a :class:`TrunkSource` for one layer at a time, in the fixed walk
order, and releases it when done; a resident source keeps every layer, a streamed source
(``k3core.trunk.stream``) cycles them through a pinned set and a ring. :class:`ModelTables`
holds the embedding, the final norms and the head (streamed in ultra-low-memory mode).
A *tensor reader* is anything with ``read(name) -> ndarray`` and ``__contains__``:
the checkpoint index, or the oracle adapter used by the tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import numpy as np

from k3core.api.errors import CheckpointError, K3Error
from k3core.api.experts import ExpertWeights
from k3core.api.kernels import KernelBackend, Mxfp4
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import LayerParams, _vec, prepare_layer, trunk_suffixes


class TensorReader(Protocol):
    def read(self, name: str) -> np.ndarray: ...

    def __contains__(self, name: object) -> bool: ...


class TrunkSource(ABC):
    """Serves bound layers in walk order; a layer stays valid until released."""

    @abstractmethod
    def acquire(self, layer: int) -> LayerParams: ...

    def begin_mlp(self, layer: int) -> None:  # noqa: B027 - resident layers are whole
        """Attention of ``layer`` is done: bind its MLP tensors (a streamed source may drop
        the attention tensors' views now and serve the MLP part from another slot)."""

    def release(self, layer: int) -> None:  # noqa: B027 - resident sources keep everything
        """The caller is done with ``layer`` (its slot may be reused)."""

    def peek(self, layer: int) -> LayerParams | None:
        """``layer`` if it is resident or already read, without waiting or holding it
        (``None`` otherwise). Valid only until the next ``acquire``: the router lookahead
        reads a later layer's gate with it while the current layer is held."""
        return None

    def close(self) -> None:  # noqa: B027
        """Stop reader threads and free buffers."""


class ResidentTrunk(TrunkSource):
    """Every layer bound once, up front."""

    def __init__(
        self,
        cfg: ModelConfig,
        reader: TensorReader,
        n_layers: int,
        progress: Callable[[int], None] | None = None,
    ):
        self.layers: list[LayerParams] = []
        for L in range(n_layers):
            raw = {s: reader.read(names.layer_name(L, s)) for s in _present(cfg, reader, L)}
            self.layers.append(prepare_layer(cfg, L, raw))
            if progress:
                progress(L)

    def acquire(self, layer: int) -> LayerParams:
        return self.layers[layer]

    def peek(self, layer: int) -> LayerParams | None:
        return self.layers[layer] if 0 <= layer < len(self.layers) else None


def _present(cfg: ModelConfig, reader: TensorReader, layer: int) -> list[str]:
    want = trunk_suffixes(cfg, layer)
    missing = [s for s in want if names.layer_name(layer, s) not in reader]
    if missing:
        raise CheckpointError(
            f"layer {layer}: missing tensor {names.layer_name(layer, missing[0])}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; is the shard set complete? (--layers N runs only the first N layers)"
        )
    return want


class ModelTables:
    """Embedding, final norm, model-level AttnRes fold and the head.

    The head and the vectors are resident. A reader that can read one row
    (``read_row(name, row)``, the checkpoint index) serves the embedding a row per token id,
    so the 163840-row table is never loaded (bf16 row gathers, the same bits); any other
    reader (the oracle adapter) loads it whole.
    """

    def __init__(self, cfg: ModelConfig, reader: TensorReader):
        self.cfg = cfg
        E, V = cfg.hidden, cfg.vocab
        for n in names.MODEL_TABLES:
            if n not in reader:
                raise CheckpointError(f"missing model tensor {n}")
        row = getattr(reader, "read_row", None)
        info = getattr(reader, "info", None)
        self._row: Callable[[str, int], np.ndarray] | None = row if info is not None else None
        self.embed_w: np.ndarray | None = None
        if self._row is None or info is None:
            self.embed_w = _checked(reader.read(names.EMBED), (V, E), names.EMBED)
        else:  # checked from the header; no row is read until a token asks for it
            t = info(names.EMBED)
            _check_meta(tuple(t.shape), t.np_dtype, (V, E), names.EMBED)
        self.head_w = _checked(reader.read(names.LM_HEAD), (V, E), names.LM_HEAD)
        self.norm = _vec(_checked(reader.read(names.NORM), (E,), names.NORM))
        rn = _vec(_checked(reader.read(names.OUT_RES_NORM), (E,), names.OUT_RES_NORM))
        rp = _vec(_checked(reader.read(names.OUT_RES_PROJ), (1, E), names.OUT_RES_PROJ))
        self.fold_out = rn * rp

    @property
    def resident_bytes(self) -> int:
        """What the tables hold: the head, the embedding when loaded whole, three vectors."""
        embed = 0 if self.embed_w is None else self.embed_w.nbytes
        return self.head_w.nbytes + embed + 3 * 4 * self.cfg.hidden

    def embed(self, ids: np.ndarray) -> np.ndarray:
        if self.embed_w is not None:
            rows = self.embed_w[ids]
        else:
            flat = np.asarray(ids).reshape(-1)
            for pos, i in enumerate(flat):
                if not 0 <= int(i) < self.cfg.vocab:
                    raise K3Error(f"token id {int(i)} at position {pos} is outside the "
                                  "vocabulary")
            got = [self._row(names.EMBED, int(i)) for i in flat] if self._row else []
            rows = np.stack(got).reshape(*np.shape(ids), self.cfg.hidden) if got else \
                np.empty((*np.shape(ids), self.cfg.hidden), dtype=np.uint16)
        if rows.dtype == np.uint16:
            return (rows.astype(np.uint32) << 16).view(np.float32)
        return np.ascontiguousarray(rows, dtype=np.float32)

    def logits(self, kernels: KernelBackend, x: np.ndarray) -> np.ndarray:
        w = self.head_w if self.head_w.dtype != np.float16 else self.head_w.astype(np.float32)
        return kernels.matmul(w, x)


def _checked(a: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    _check_meta(tuple(a.shape), a.dtype, shape, name)
    return a


def _check_meta(got: tuple[int, ...], dtype: np.dtype, shape: tuple[int, ...], name: str) -> None:
    if got != shape:
        raise CheckpointError(f"{name} has shape {list(got)}, expected {list(shape)}")
    if dtype.type not in (np.uint16, np.float16, np.float32):
        raise CheckpointError(f"{name} has dtype {dtype}, expected bf16, f16 or f32")


def expert_from_reader(cfg: ModelConfig, reader: TensorReader, layer: int, e: int) -> ExpertWeights:
    """Load one routed expert's three matrices (MXFP4 packed, or dense for the oracle)."""
    Lt, inter = cfg.latent, cfg.moe_inter
    shapes = {"w1": (inter, Lt), "w3": (inter, Lt), "w2": (Lt, inter)}
    parts: dict[str, Mxfp4 | np.ndarray] = {}
    for part, (rows, cols) in shapes.items():
        packed = names.expert_name(layer, e, part, "weight_packed")
        if packed in reader:
            p = reader.read(packed)
            s = reader.read(names.expert_name(layer, e, part, "weight_scale"))
            parts[part] = checked_mxfp4(p, s, rows, cols, packed)
        else:
            dense = names.expert_name(layer, e, part, "weight")
            if dense not in reader:
                raise CheckpointError(f"missing routed expert tensor {packed}")
            w = reader.read(dense)
            if tuple(w.shape) != (rows, cols):
                raise CheckpointError(f"{dense} has shape {list(w.shape)}, expected {[rows, cols]}")
            parts[part] = w.astype(np.float32) if w.dtype == np.float16 else w
    return ExpertWeights(parts["w1"], parts["w3"], parts["w2"])


def checked_mxfp4(p: np.ndarray, s: np.ndarray, rows: int, cols: int, name: str) -> Mxfp4:
    """Validate packed/scale shapes against the logical ``[rows, cols]``."""
    if p.dtype != np.uint8 or s.dtype != np.uint8:
        raise CheckpointError(f"{name}: MXFP4 tensors must be U8")
    if cols % 32 or tuple(p.shape) != (rows, cols // 2) or tuple(s.shape) != (rows, cols // 32):
        raise CheckpointError(
            f"{name}: packed {list(p.shape)} / scales {list(s.shape)} do not describe a "
            f"[{rows}, {cols}] MXFP4 matrix (packed cols = in/2, scale cols = in/32)"
        )
    return Mxfp4(np.ascontiguousarray(p), np.ascontiguousarray(s))
