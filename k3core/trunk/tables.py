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

Given the packed trunk (``trunk=``), every byte is checked against the CRC-32s its manifest
holds for these tables (one per ``chunk_rows`` rows) before it is first used: an embedding
row's whole chunk is read and checked the first time a token of that chunk appears (the
row is then taken from it), and each ``lm_head`` chunk on the first pass (on every pass
with ``verify_every``). A mismatch is a ``CheckpointError`` (exit 1) naming the table and
rows. A trunk packed without table checksums cannot run ultra-low-memory (repack it).
"""

from __future__ import annotations

import time
import zlib
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
from k3core.trunk.manifest import TableChecksums, crc_tag

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
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, *, trunk: object | None = None,
                 verify_every: bool | None = None):
        self.cfg = cfg
        self.index = index
        self.checks = _checks_of(trunk)
        self.verify_every = bool(getattr(trunk, "verify_every", False)
                                 if verify_every is None else verify_every)
        self._seen: dict[str, set[int]] = {names.EMBED: set(), names.LM_HEAD: set()}
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
        if self.checks is not None:  # whole checksum chunks per read
            per = self.checks[names.LM_HEAD].chunk_rows
            self.rows_per_chunk = max(per, self.rows_per_chunk // per * per)
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
                raw = self._embed_row(i, row)
            except K3Error as exc:
                raise type(exc)(f"embedding row load failed for token {i} at position {pos}: "
                                f"{exc.message}") from None
            r = raw.view(t.np_dtype)
            out[pos] = (r.astype(np.uint32) << 16).view(np.float32) if r.dtype == np.uint16 \
                else r.astype(np.float32)
        self.stats.embedding_seconds += time.perf_counter() - t0
        return out

    def _embed_row(self, i: int, row: int) -> np.ndarray:
        t = self.embed_info
        check = self.checks[names.EMBED] if self.checks is not None else None
        if check is None or (i // check.chunk_rows in self._seen[names.EMBED]
                             and not self.verify_every):
            self.stats.embedding_bytes_read += row
            return self.index.read_range(t.path, t.offset + i * row, row)
        c = i // check.chunk_rows
        r0, r1 = c * check.chunk_rows, min(self.cfg.vocab, (c + 1) * check.chunk_rows)
        data = self.index.read_range(t.path, t.offset + r0 * row, (r1 - r0) * row)
        self.stats.embedding_bytes_read += data.nbytes
        self._verify(check, c, data, r0, r1)
        self._seen[names.EMBED].add(c)
        return data[(i - r0) * row : (i - r0 + 1) * row]

    def _verify(self, check: TableChecksums, c: int, data: np.ndarray, r0: int, r1: int) -> None:
        crc = crc_tag(zlib.crc32(data.data))
        if crc != check.checksums[c]:
            raise CheckpointError(f"{check.name} rows {r0}..{r1 - 1} fail their checksum "
                                  f"({crc}, trunk manifest {check.checksums[c]}); the "
                                  "checkpoint's bytes changed since the trunk was packed")

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
            self._verify_head(raw, r0, r1, row)
            w = raw.view(t.np_dtype).reshape(r1 - r0, E)
            if w.dtype == np.float16:
                w = w.astype(np.float32)
            out[:, r0:r1] = kernels.matmul(w, x)
        return out


    def _verify_head(self, raw: np.ndarray, r0: int, r1: int, row: int) -> None:
        if self.checks is None:
            return
        check = self.checks[names.LM_HEAD]
        per = check.chunk_rows  # r0 is a multiple of per (rows_per_chunk is)
        seen = self._seen[names.LM_HEAD]
        for a in range(r0, r1, per):
            c = a // per
            if c in seen and not self.verify_every:
                continue
            b = min(r1, a + per)
            self._verify(check, c, raw[(a - r0) * row : (b - r0) * row], a, b)
            seen.add(c)


def _checks_of(trunk: object | None) -> dict[str, TableChecksums] | None:
    """The table checksums of a streamed trunk's manifest (``None`` without a trunk)."""
    if trunk is None:
        return None
    man = getattr(trunk, "manifest", None)
    tables = getattr(man, "tables", None)
    if tables is None or names.EMBED not in tables or names.LM_HEAD not in tables:
        where = getattr(man, "trunk_dir", "the packed trunk")
        raise CheckpointError(f"trunk at {where} holds no checksums for the embedding and "
                              "lm_head (packed by an older k3), so --ultra-low-memory cannot "
                              "check what it streams; repack it with `k3 pack-trunk MODEL_DIR "
                              f"{where} --force`")
    return dict(tables)


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
