"""Ultra-low-memory model tables: embedding rows and the head read from the checkpoint.

:class:`StreamedTables` serves the same interface as :class:`k3core.model.sources.ModelTables`
while keeping only the final norm and the model-level AttnRes fold resident. ``embed``
reads one embedding row per token id; ``logits`` reads ``lm_head`` in bounded row chunks
(``chunk_bytes``, default 64 MiB) and multiplies each chunk as it arrives. Matmul rows are
independent under the kernel contract (each output is its own lane sum), so the result is
bit-identical to the resident tables. Reads go through the checkpoint index's storage
backend; a failed read fails the forward pass and is never used. Bytes and seconds are
counted separately for the embedding and the head (``embedding_bytes_read``,
``lm_head_bytes_read``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from k3core.api.errors import CheckpointError, K3Error
from k3core.api.kernels import KernelBackend
from k3core.api.units import human
from k3core.checkpoint.index import CheckpointIndex, TensorInfo
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import _vec
from k3core.model.sources import ModelTables

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass
class TableStats:
    embedding_bytes_read: int = 0
    embedding_seconds: float = 0.0
    lm_head_bytes_read: int = 0
    lm_head_seconds: float = 0.0

    def to_json(self) -> dict[str, float | int]:
        return {
            "embedding_bytes_read": self.embedding_bytes_read,
            "embedding_read_seconds": self.embedding_seconds,
            "lm_head_bytes_read": self.lm_head_bytes_read,
            "lm_head_read_seconds": self.lm_head_seconds,
        }

    def report_line(self) -> str:
        return (f"model tables (STREAMED): embedding {human(self.embedding_bytes_read)} in "
                f"{self.embedding_seconds:.2f} s, lm_head {human(self.lm_head_bytes_read)} in "
                f"{self.lm_head_seconds:.2f} s")


class StreamedTables(ModelTables):
    """Embedding and head streamed from ``index``; norms resident (no super().__init__:
    the resident tables are exactly what this class does not load)."""

    def __init__(self, cfg: ModelConfig, index: CheckpointIndex,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.cfg = cfg
        self.index = index
        E, V = cfg.hidden, cfg.vocab
        for n in names.MODEL_TABLES:
            if n not in index:
                raise CheckpointError(f"missing model tensor {n}")
        self.embed_info = _table(index, names.EMBED, V, E)
        self.head_info = _table(index, names.LM_HEAD, V, E)
        self.norm = _vec(_small(index, names.NORM, (E,)))
        rn = _vec(_small(index, names.OUT_RES_NORM, (E,)))
        rp = _vec(_small(index, names.OUT_RES_PROJ, (1, E)))
        self.fold_out = rn * rp
        row = E * self.head_info.np_dtype.itemsize
        self.rows_per_chunk = max(1, int(chunk_bytes) // row)
        self.stats = TableStats()

    @property
    def resident_bytes(self) -> int:
        """What the tables hold: one head chunk plus the three vectors."""
        row = self.cfg.hidden * self.head_info.np_dtype.itemsize
        return self.rows_per_chunk * row + 3 * 4 * self.cfg.hidden

    def embed(self, ids: np.ndarray) -> np.ndarray:
        t = self.embed_info
        E = self.cfg.hidden
        row = E * t.np_dtype.itemsize
        out = np.empty((len(ids), E), dtype=np.float32)
        t0 = time.perf_counter()
        for pos, i in enumerate(np.asarray(ids).reshape(-1)):
            i = int(i)
            if not 0 <= i < self.cfg.vocab:
                raise K3Error(f"token id {i} at position {pos} is outside the vocabulary")
            try:
                raw = self.index.read_range(t.path, t.offset + i * row, row)
            except K3Error as exc:
                raise type(exc)(f"embedding row load failed for token {i} at position {pos}: "
                                f"{exc.message}") from None
            r = raw.view(t.np_dtype)
            out[pos] = (r.astype(np.uint32) << 16).view(np.float32) if r.dtype == np.uint16 \
                else r.astype(np.float32)
            self.stats.embedding_bytes_read += row
        self.stats.embedding_seconds += time.perf_counter() - t0
        return out

    def logits(self, kernels: KernelBackend, x: np.ndarray) -> np.ndarray:
        t = self.head_info
        E, V = self.cfg.hidden, self.cfg.vocab
        row = E * t.np_dtype.itemsize
        out = np.empty((x.shape[0], V), dtype=np.float32)
        for r0 in range(0, V, self.rows_per_chunk):
            r1 = min(V, r0 + self.rows_per_chunk)
            t0 = time.perf_counter()
            try:
                raw = self.index.read_range(t.path, t.offset + r0 * row, (r1 - r0) * row)
            except K3Error as exc:
                raise type(exc)(f"lm_head rows {r0}..{r1 - 1}: {exc.message}") from None
            self.stats.lm_head_seconds += time.perf_counter() - t0
            self.stats.lm_head_bytes_read += raw.nbytes
            w = raw.view(t.np_dtype).reshape(r1 - r0, E)
            if w.dtype == np.float16:
                w = w.astype(np.float32)
            out[:, r0:r1] = kernels.matmul(w, x)
        return out


def _table(index: CheckpointIndex, name: str, V: int, E: int) -> TensorInfo:
    info = index.info(name)
    if info.shape != (V, E):
        raise CheckpointError(f"{name} has shape {list(info.shape)}, expected {[V, E]}")
    if info.dtype not in ("BF16", "F16", "F32"):
        raise CheckpointError(f"{name} has dtype {info.dtype}, expected bf16, f16 or f32")
    return info


def _small(index: CheckpointIndex, name: str, shape: tuple[int, ...]) -> np.ndarray:
    a = index.read(name)
    if tuple(a.shape) != shape:
        raise CheckpointError(f"{name} has shape {list(a.shape)}, expected {list(shape)}")
    if a.dtype.type not in (np.uint16, np.float16, np.float32):
        raise CheckpointError(f"{name} has dtype {a.dtype}, expected bf16, f16 or f32")
    return a
