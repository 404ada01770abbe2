"""The completed AttnRes blocks of one forward pass, kept where ``attn_res`` reads them.

Every attention residual (docs/model.md §5.2) takes the pass's completed blocks plus the
current partial sum as one ``[S, T, E]`` source array. Stacking ``blocks + [x]`` afresh for
each of a layer's two residuals copied every completed block twice a layer: on the medium
model's 128-id prefill, about 180 MB of copies into freshly allocated arrays over the 25
layers, for residuals that read each byte once. Here the blocks live in one buffer with a
spare row after them: a residual writes only ``x`` into that row and hands the kernel a view
of the first rows, and a block that completes is written once, into the next row. The
sources hold the same values in the same order, so the residuals' bits are unchanged.
"""

from __future__ import annotations

import numpy as np


class BlockStack:
    """Completed blocks of ``[T, E]`` float32 rows, at most ``capacity - 1`` of them."""

    def __init__(self, rows: int, width: int, capacity: int):
        self._buf = np.empty((max(1, capacity), rows, width), dtype=np.float32)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def sources(self, x: np.ndarray) -> np.ndarray:
        """``stack(blocks + [x])``: a view valid until the next ``sources`` or ``append``."""
        self._buf[self._n] = x
        return self._buf[: self._n + 1]

    def append(self, x: np.ndarray) -> None:
        """``x`` becomes the next completed block (a spare row stays for ``sources``)."""
        if self._n + 2 > self._buf.shape[0]:
            raise IndexError(f"BlockStack: room for {self._buf.shape[0] - 1} blocks")
        self._buf[self._n] = x
        self._n += 1

    def completed(self) -> np.ndarray:
        """The completed blocks, ``[len(self), T, E]`` (a view, valid until the next call)."""
        return self._buf[: self._n]

    def keep_rows(self, rows: np.ndarray) -> None:
        """Keep only the rows ``rows`` (indices, in order) of every block (the last layer's
        asked rows)."""
        if rows.size >= self._buf.shape[1]:
            return
        buf = np.empty((self._buf.shape[0], rows.size, self._buf.shape[2]), dtype=np.float32)
        buf[: self._n] = self._buf[: self._n, rows]
        self._buf = buf
