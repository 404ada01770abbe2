"""A cheap content check that a packed trunk belongs to *this* checkpoint's bytes.

The checkpoint fingerprint covers shard names, sizes and headers, which two checkpoints
of one architecture (two fine-tunes, two synthetic seeds) share exactly. So the packer
also records ``source_sample``: a SHA-256 over three 4 KiB windows of every layer's run
(start, middle, end) as read from the checkpoint. At open k3 re-reads those windows from
the checkpoint and from ``trunk.bin`` (aligned reads, so O_DIRECT backends need no
fix-up): a different digest means the trunk was packed from other weights, and
``trunk.bin`` bytes that differ from the checkpoint's mean the file was damaged or
swapped. About 6 small reads per layer; ``--verify-trunk`` checks every byte instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from k3core.api.errors import CheckpointError, K3Error
from k3core.api.storage import StorageBackend, aligned_empty
from k3core.checkpoint.index import CheckpointIndex

WINDOW = 4096


def windows(span: int) -> list[tuple[int, int]]:
    """``(offset, length)`` windows inside a run of ``span`` bytes, offsets 4096-aligned."""
    offs = sorted({0, (span // 2) // WINDOW * WINDOW, ((span - 1) // WINDOW) * WINDOW})
    return [(o, min(WINDOW, span - o)) for o in offs]


def source_sample(index: CheckpointIndex, runs: Iterable[tuple[Path, int, int]]) -> str:
    """Digest of the checkpoint's bytes at the sample windows of ``(path, start, span)`` runs."""
    h = hashlib.sha256()
    for path, start, span in runs:
        for off, n in windows(span):
            h.update(_read_source(index, path, start + off, n))
    return "sha256:" + h.hexdigest()


def _read_source(index: CheckpointIndex, path: Path, offset: int, n: int) -> bytes:
    try:
        return index.read_range(path, offset, n).tobytes()
    except K3Error as exc:
        raise CheckpointError(f"checking the packed trunk against {path}: {exc.message}") from None


def check_samples(root: Path, bin_path: Path, index: CheckpointIndex, storage: StorageBackend,
                  layers: list[tuple[int, Path, int, int, int]], recorded: str, *,
                  compare_bin: bool = True) -> None:
    """``layers``: ``(layer, shard, run start, span, file_off)``; refuse a mismatch.

    ``compare_bin=False`` (a compressed trunk, whose ``trunk.bin`` holds encoded windows)
    checks the checkpoint's digest only; the raw bytes are checked by their CRC-32 when
    they are decoded."""
    if source_sample(index, ((p, s, span) for _, p, s, span, _ in layers)) != recorded:
        raise CheckpointError(f"trunk at {root} was packed from a different checkpoint than "
                              f"{index.model_dir} (same layout, different weights); repack it "
                              f"with `k3 pack-trunk {index.model_dir} {root} --force`")
    if not compare_bin:
        return
    buf = aligned_empty(WINDOW, WINDOW)
    try:
        f = storage.open(bin_path)
    except (K3Error, OSError) as exc:
        raise CheckpointError(f"{bin_path}: cannot open the packed trunk: "
                              f"{getattr(exc, 'message', exc)}") from None
    try:
        for L, p, start, span, file_off in layers:
            for off, n in windows(span):
                try:
                    f.read_into(file_off + off, buf)
                except K3Error as exc:
                    raise CheckpointError(f"{bin_path}: layer {L}: {exc.message}") from None
                if not np.array_equal(buf[:n], np.frombuffer(_read_source(index, p, start + off, n),
                                                             dtype=np.uint8)):
                    raise CheckpointError(f"{bin_path}: layer {L} does not hold the checkpoint's "
                                          "bytes (damaged or replaced); repack the trunk")
    finally:
        f.close()
