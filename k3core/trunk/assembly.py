"""Checking and gathering a split layer from the pieces it arrives in.

:class:`LayerAssembly` is fed each source of a layer as its bytes arrive (the resident
ranges read at open, each part's first read): it takes the CRC-32 of the segments that
source owns and copies out the bytes of the small tensors it covers. When every segment is
in, :meth:`LayerAssembly.problem` compares the combined CRC with the manifest's, and
:meth:`LayerAssembly.small_raw` hands the gathered small tensors to ``bind_small``. The
per-segment CRCs stay as the layer's trusted pieces, so ``--verify-trunk`` can check every
later read of a part on its own.
"""

from __future__ import annotations

import zlib

import numpy as np

from k3core.model import names
from k3core.trunk.crc import crc32_combine
from k3core.trunk.manifest import TrunkLayer, TrunkManifest, checksum_failure
from k3core.trunk.parts import LayerSplit


class LayerAssembly:
    def __init__(self, lay: TrunkLayer, split: LayerSplit):
        self.lay = lay
        self.split = split
        self.crcs: list[int | None] = [None] * len(split.segments)
        self._raw = {s: np.empty(n, np.uint8) for s, (_, n) in split.small.items()}
        self._running: dict[int, int] = {}  # segment -> CRC so far (a part read in pieces)

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.crcs)

    def fed(self, owner: int) -> bool:
        return all(c is not None for c, s in zip(self.crcs, self.split.segments, strict=True)
                   if s.owner == owner)

    def feed(self, owner: int, buf: np.ndarray, buf_start: int) -> None:
        """Take what ``owner`` owns of the run bytes ``buf`` holds from ``buf_start``.

        A part may arrive in several pieces (read through a slot smaller than it), in
        order: a segment's CRC runs on across pieces and is final at the segment's end.
        """
        buf_end = buf_start + buf.nbytes
        for i, seg in enumerate(self.split.segments):
            if seg.owner != owner:
                continue
            lo, hi = max(seg.start, buf_start), min(seg.end, buf_end)
            if lo >= hi:
                continue
            run = self._running.get(i, 0) if lo > seg.start else 0
            run = zlib.crc32(buf[lo - buf_start : hi - buf_start].data, run)
            if hi == seg.end:
                self.crcs[i] = run
                self._running.pop(i, None)
            else:
                self._running[i] = run
            for s, (off, n) in self.split.small.items():
                a, b = max(off, lo), min(off + n, hi)
                if a < b and s in self._raw:
                    self._raw[s][a - off : b - off] = buf[a - buf_start : b - buf_start]

    def crc(self) -> int:
        total = 0
        for c, seg in zip(self.crcs, self.split.segments, strict=True):
            assert c is not None
            total = crc32_combine(total, c, seg.end - seg.start)
        return total

    def problem(self, man: TrunkManifest) -> str | None:
        """``None`` when the gathered layer matches its checksum."""
        return checksum_failure(man, self.lay, self.crc())

    def part_problem(self, man: TrunkManifest, owner: int, buf: np.ndarray) -> str | None:
        """A later read of part ``owner`` checked against the trusted segment CRCs."""
        part = self.split.parts[owner]
        for c, seg in zip(self.crcs, self.split.segments, strict=True):
            if part.start <= seg.start and seg.end <= part.end:
                got = zlib.crc32(buf[seg.start - part.start : seg.end - part.start].data)
                if got != c:
                    return (f"{man.bin_path}: layer {self.lay.layer} fails its checksum on a "
                            f"re-read (part {part.name}, bytes [{seg.start}, {seg.end}) "
                            "changed since first use); the file is damaged, repack the trunk")
        return None

    def drop_raw(self) -> None:
        self._raw = {}

    def small_raw(self) -> dict[str, np.ndarray]:
        out = {}
        for t in self.lay.tensors.values():
            s = names.split_layer_name(t.name)
            assert s is not None
            if s[1] in self._raw:
                out[s[1]] = self._raw[s[1]].view(t.np_dtype).reshape(t.shape)
        return out
