"""Model tables for a streamed trunk: the head resident, embedding rows read on demand.

A decode step embeds one token but multiplies the whole ``lm_head``; holding the whole
embedding table (``vocab x hidden`` bf16: 100 MB at the medium shape, 2.3 GB for Kimi K3)
buys nothing there. :class:`RowEmbedTables` keeps the head, the final norm and the
model-level AttnRes fold resident (as :class:`k3core.model.sources.ModelTables`) and reads
each embedding row from the checkpoint when a token needs it, through the index's storage
backend. The rows are the same bytes widened the same way, so the logits are bit-identical
to the resident tables'. A failed row read fails the forward pass (exit 1) naming the token.
"""

from __future__ import annotations

import numpy as np

from k3core.api.errors import CheckpointError, K3Error
from k3core.checkpoint.index import CheckpointIndex
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import _vec
from k3core.model.sources import ModelTables, _checked


class RowEmbedTables(ModelTables):
    """Resident head and vectors; embedding rows read per token (no super().__init__: the
    embedding table is exactly what this class does not load)."""

    def __init__(self, cfg: ModelConfig, index: CheckpointIndex):
        self.cfg = cfg
        self.index = index
        E, V = cfg.hidden, cfg.vocab
        for n in names.MODEL_TABLES:
            if n not in index:
                raise CheckpointError(f"missing model tensor {n}")
        info = index.info(names.EMBED)
        if tuple(info.shape) != (V, E):
            raise CheckpointError(f"{names.EMBED} has shape {list(info.shape)}, expected "
                                  f"{[V, E]}")
        self.embed_info = info
        self.embed_dtype = np.dtype(info.np_dtype)
        if self.embed_dtype.type not in (np.uint16, np.float16, np.float32):
            raise CheckpointError(f"{names.EMBED} has dtype {self.embed_dtype}, expected bf16, "
                                  "f16 or f32")
        self.head_w = _checked(index.read(names.LM_HEAD), (V, E), names.LM_HEAD)
        self.norm = _vec(_checked(index.read(names.NORM), (E,), names.NORM))
        rn = _vec(_checked(index.read(names.OUT_RES_NORM), (E,), names.OUT_RES_NORM))
        rp = _vec(_checked(index.read(names.OUT_RES_PROJ), (1, E), names.OUT_RES_PROJ))
        self.fold_out = rn * rp
        self.embedding_bytes_read = 0

    @property
    def resident_bytes(self) -> int:
        return self.head_w.nbytes + 3 * 4 * self.cfg.hidden

    def embed(self, ids: np.ndarray) -> np.ndarray:
        E = self.cfg.hidden
        row = E * self.embed_dtype.itemsize
        flat = np.asarray(ids).reshape(-1)
        raw = np.empty((len(flat), E), dtype=self.embed_dtype)
        t = self.embed_info
        for pos, i in enumerate(flat):
            i = int(i)
            if not 0 <= i < self.cfg.vocab:
                raise K3Error(f"token id {i} at position {pos} is outside the vocabulary")
            try:
                raw[pos] = self.index.read_range(t.path, t.offset + i * row, row).view(
                    self.embed_dtype)
            except K3Error as exc:
                raise type(exc)(f"embedding row load failed for token {i} at position {pos}: "
                                f"{exc.message}") from None
            self.embedding_bytes_read += row
        if raw.dtype == np.uint16:
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return np.ascontiguousarray(raw, dtype=np.float32)
